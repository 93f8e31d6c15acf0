//! A generation as an async stream: the engine's blocking event iterator
//! runs on a blocking thread and forwards events to the request's task.
//! Dropping the [`Generation`] (a client that hangs up) cancels the row,
//! which ends within one engine step; the slot is freed when the row has
//! ended, so its KV blocks are back in the pool before the slot is reused.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mlxcel_engine::{CancelFlag, Engine, FinishReason, GenerationRequest, GenerationStream, StreamEvent};
use tokio::sync::mpsc;

use crate::state::{AppState, SlotGuard};

pub struct Generation {
    /// The slot the generation runs in.
    pub slot: usize,
    events: mpsc::UnboundedReceiver<StreamEvent>,
    cancel: CancelFlag,
}

impl Generation {
    /// Queues `request` (whose cancel flag must be `cancel`) on the engine.
    pub fn start(state: &Arc<AppState>, engine: &Engine, request: GenerationRequest, cancel: CancelFlag, slot: SlotGuard) -> Generation {
        debug_assert!(request.cancel.is_some());
        let slot_id = slot.slot;
        let (sender, events) = mpsc::unbounded_channel();
        let engine = engine.clone();
        let state = state.clone();
        tokio::task::spawn_blocking(move || {
            let mut decoded = 0;
            for event in GenerationStream::start(&engine, request) {
                if let StreamEvent::Done(output) = &event {
                    record(&state, output);
                }
                if matches!(event, StreamEvent::Piece { .. }) {
                    decoded += 1;
                    slot.decoded(decoded);
                }
                // A closed receiver means the client left: the cancel flag is
                // already set, so keep draining until the row ends.
                let _ = sender.send(event);
            }
            drop(slot);
        });
        Generation { slot: slot_id, events, cancel }
    }

    pub async fn next(&mut self) -> Option<StreamEvent> {
        self.events.recv().await
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn record(state: &AppState, output: &mlxcel_engine::GenerationOutput) {
    let m = &state.metrics;
    let s = &output.stats;
    m.prompt_tokens_total.fetch_add((s.prompt_tokens - s.cached_tokens.min(s.prompt_tokens)) as u64, Ordering::Relaxed);
    m.cached_tokens_total.fetch_add(s.cached_tokens as u64, Ordering::Relaxed);
    m.prompt_seconds_total_us.fetch_add(s.prompt_time.as_micros() as u64, Ordering::Relaxed);
    m.tokens_predicted_total.fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
    m.tokens_predicted_seconds_total_us.fetch_add(s.decode_time.as_micros() as u64, Ordering::Relaxed);
    if output.finish_reason == FinishReason::Cancelled {
        m.requests_cancelled_total.fetch_add(1, Ordering::Relaxed);
    }
}
