//! The registry of live handles.
//!
//! A handle given to C is not a pointer to memory: it encodes a never-reused
//! 60-bit id and a 4-bit kind tag. Every call looks the id up in the table of
//! its kind, so NULL, a garbage value, a handle of the wrong kind, or a freed
//! handle (double free, use after free) is an `MLXCEL_ERR_INVALID_HANDLE`
//! instead of a crash. The table holds an `Arc`; a call clones it out, so an
//! object freed by one thread while another thread uses it stays alive until
//! that use ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::status::{guard_or, mlxcel_status, CError, CResult, MLXCEL_ERR_INVALID_HANDLE, MLXCEL_OK};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct Registry<T> {
    kind: usize,
    name: &'static str,
    live: Mutex<Option<HashMap<u64, Arc<T>>>>,
}

impl<T> Registry<T> {
    pub const fn new(kind: usize, name: &'static str) -> Self {
        Registry {
            kind,
            name,
            live: Mutex::new(None),
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Option<HashMap<u64, Arc<T>>>> {
        // A panic while holding the lock cannot leave the map half-updated.
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `value` and returns its handle value.
    pub fn insert(&self, value: Arc<T>) -> usize {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.table()
            .get_or_insert_with(HashMap::new)
            .insert(id, value);
        ((id as usize) << 4) | self.kind
    }

    fn id_of(&self, handle: usize) -> CResult<u64> {
        if handle == 0 {
            return Err(CError::null(self.name));
        }
        if handle & 0xf != self.kind {
            return Err(self.invalid(handle));
        }
        Ok((handle >> 4) as u64)
    }

    fn invalid(&self, handle: usize) -> CError {
        CError::new(
            MLXCEL_ERR_INVALID_HANDLE,
            format!(
                "{:#x} is not a live {} handle (never created, already freed, or of another kind)",
                handle, self.name
            ),
        )
    }

    /// The object behind a live handle.
    pub fn get(&self, handle: usize) -> CResult<Arc<T>> {
        let id = self.id_of(handle)?;
        self.table()
            .as_ref()
            .and_then(|t| t.get(&id).cloned())
            .ok_or_else(|| self.invalid(handle))
    }

    /// Calls `f` on every live object (under the table's lock: keep it short).
    pub fn for_each(&self, mut f: impl FnMut(&T)) {
        if let Some(table) = self.table().as_ref() {
            table.values().for_each(|v| f(v));
        }
    }

    /// Unregisters a handle, returning its object; a second call fails.
    pub fn remove(&self, handle: usize) -> CResult<Arc<T>> {
        let id = self.id_of(handle)?;
        self.table()
            .as_mut()
            .and_then(|t| t.remove(&id))
            .ok_or_else(|| self.invalid(handle))
    }

    /// The body of a `mlxcel_*_free`: unregisters `handle` (0 is a no-op).
    /// During exit the object is leaked rather than dropped, so no MLX
    /// destructor runs after MLX's statics are gone.
    pub fn free(&self, handle: usize) -> mlxcel_status {
        let free = |leak: bool| {
            if handle != 0 {
                let object = self.remove(handle)?;
                if leak {
                    std::mem::forget(object);
                }
            }
            Ok(MLXCEL_OK)
        };
        guard_or(|_| free(false), || free(true))
    }
}
