//! The scheduler: one thread per [`Engine`](crate::Engine) that owns its
//! [`BatchEngine`] and decides, tick by tick, what runs. Requests arrive from
//! any thread over a `crossbeam-channel`; each tick the scheduler
//!
//! 1. admits waiting requests as rows, first come first served, while fewer
//!    than [`MAX_ROWS`] run and the KV pool has room for the next one's
//!    prompt and `max_tokens` (a request too large for the whole pool fails
//!    with [`Error::KvPoolTooSmall`]);
//! 2. ends rows whose cancel flag is set or whose client went away;
//! 3. queues one decode step over every decoding row;
//! 4. runs one prefill chunk of the oldest prefilling row, so a long prompt
//!    delays the decoding rows by at most one chunk per token (short prompts
//!    of one length that arrive together prefill in one batched forward,
//!    within that chunk's budget);
//! 5. reads the step's tokens back and sends each row's events to its client.
//!
//! Concurrent `generate` calls on one engine are therefore batched: their
//! decode steps share one forward pass.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use mlxcel_models::paged::KvPool;
use mlxcel_models::Model;

use crate::batch::{BatchEngine, RowEvent, RowId, RowRequest};
use crate::error::Error;
use crate::generate::{CancelFlag, FinishReason};

/// Most rows decoding at once; later requests wait in the queue.
pub const MAX_ROWS: usize = 32;

/// A request on its way to the scheduler thread.
struct Submission {
    request: RowRequest,
    /// Set by the client to end its row (a dropped stream, a callback that
    /// returned false).
    client_cancel: CancelFlag,
    events: Sender<RowEvent>,
    submitted: Instant,
}

/// What the thread shares with [`shutdown`].
struct Shared {
    /// True while the thread works on rows (it may be inside MLX).
    busy: Mutex<bool>,
    idle: Condvar,
}

impl Shared {
    fn set_busy(&self, busy: bool) {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = busy;
        if !busy {
            self.idle.notify_all();
        }
    }
}

static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);
static SCHEDULERS: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

/// The handle of one scheduler. Engines and streams share it; dropping the
/// last one stops the scheduler (its rows were cancelled by their streams'
/// drops) and waits until it has, so the model is freed by then; its thread
/// then waits to serve the next engine.
pub(crate) struct Scheduler {
    sender: Option<Sender<Submission>>,
    stopped: Receiver<()>,
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.sender = None;
        // Disconnected when the scheduler's loop has returned.
        let _ = self.stopped.recv();
    }
}

impl Scheduler {
    /// `draft`: the draft model rows may speculate with (checked against
    /// `model` by the caller, [`crate::batch::check_draft_model`]).
    pub fn start(model: Arc<Model>, pool: Arc<KvPool>, prefix_caching: bool, max_rows: usize, draft: Option<Arc<Model>>) -> Scheduler {
        let (sender, receiver) = unbounded();
        let shared = Arc::new(Shared { busy: Mutex::new(false), idle: Condvar::new() });
        {
            let mut all = SCHEDULERS.lock().unwrap_or_else(|e| e.into_inner());
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&shared));
        }
        let (done, stopped) = crossbeam_channel::bounded::<()>(0);
        spawn_reusing(Job { work: Box::new(move || run(model, pool, prefix_caching, max_rows, draft, receiver, shared)), finished: done });
        Scheduler { sender: Some(sender), stopped }
    }

    /// Queues `request`; its events arrive on the returned channel, ending
    /// with one `Finished` or `Failed`.
    pub fn submit(&self, request: RowRequest, client_cancel: CancelFlag) -> Receiver<RowEvent> {
        let (events, receiver) = unbounded();
        let submission = Submission { request, client_cancel, events, submitted: Instant::now() };
        let sender = self.sender.as_ref().expect("the sender lives until drop");
        if let Err(failed) = sender.send(submission) {
            let _ = failed.0.events.send(RowEvent::Failed { row: 0, error: Error::ShuttingDown });
        }
        receiver
    }
}

/// Stops every scheduler in the process for its exit: every row ends as
/// cancelled, later requests fail with [`Error::ShuttingDown`], and no
/// scheduler thread touches MLX again. Waits up to `timeout` for threads in
/// the middle of a step; returns whether all of them stopped.
pub fn shutdown(timeout: Duration) -> bool {
    SHUTTING_DOWN.store(true, Ordering::SeqCst);
    let deadline = Instant::now() + timeout;
    let all: Vec<Arc<Shared>> =
        SCHEDULERS.lock().unwrap_or_else(|e| e.into_inner()).iter().filter_map(Weak::upgrade).collect();
    let mut stopped = true;
    for shared in all {
        let mut busy = shared.busy.lock().unwrap_or_else(|e| e.into_inner());
        while *busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                stopped = false;
                break;
            }
            busy = shared.idle.wait_timeout(busy, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
    stopped
}

struct Client {
    events: Sender<RowEvent>,
    cancel: CancelFlag,
}

/// Scheduler threads outlive their engines and serve the next one. MLX gives
/// every thread that evaluates its own default stream, with a worker thread
/// that outlives it, and streams cannot move between threads: a new thread
/// per engine (or, before, per call) left one MLX worker behind each time.
/// Reusing the threads bounds them by the most engines alive at once.
/// Work for a scheduler thread, and the channel it closes once the thread
/// is idle again (so an engine's drop returns only when its thread can be
/// reused by the next engine).
struct Job {
    work: Box<dyn FnOnce() + Send>,
    finished: Sender<()>,
}
static IDLE_THREADS: Mutex<Vec<Sender<Job>>> = Mutex::new(Vec::new());

/// Runs `job` on an idle scheduler thread, or on a new one.
fn spawn_reusing(job: Job) {
    let mut job = Some(job);
    while let Some(worker) = IDLE_THREADS.lock().unwrap_or_else(|e| e.into_inner()).pop() {
        match worker.send(job.take().expect("not sent yet")) {
            Ok(()) => return,
            Err(failed) => job = Some(failed.0),
        }
    }
    let mut job = job.expect("not sent yet");
    std::thread::Builder::new()
        .name("mlxcel-scheduler".into())
        .spawn(move || loop {
            (job.work)();
            let (sender, receiver) = crossbeam_channel::bounded::<Job>(1);
            IDLE_THREADS.lock().unwrap_or_else(|e| e.into_inner()).push(sender);
            drop(job.finished);
            match receiver.recv() {
                Ok(next) => job = next,
                Err(_) => return,
            }
        })
        .expect("spawning a scheduler thread");
}

fn run(model: Arc<Model>, pool: Arc<KvPool>, prefix_caching: bool, max_rows: usize, draft: Option<Arc<Model>>, receiver: Receiver<Submission>, shared: Arc<Shared>) {
    let mut engine = BatchEngine::new(model, pool, prefix_caching);
    if let Some(draft) = draft {
        // Checked by the engine before it started this thread.
        let _ = engine.set_draft_model(draft);
    }
    let mut clients: HashMap<RowId, Client> = HashMap::new();
    let mut waiting: VecDeque<Submission> = VecDeque::new();
    loop {
        if engine.is_empty() && waiting.is_empty() {
            // Nothing of the finished rows may still be computing once idle.
            let _ = mlx_sys::Stream::default_for(mlx_sys::Device::default_device()).and_then(|s| s.synchronize());
            shared.set_busy(false);
            match receiver.recv() {
                Ok(submission) => waiting.push_back(submission),
                Err(_) => return,
            }
            shared.set_busy(true);
        }
        waiting.extend(receiver.try_iter());
        if SHUTTING_DOWN.load(Ordering::SeqCst) {
            for submission in waiting.drain(..) {
                let _ = submission.events.send(RowEvent::Failed { row: 0, error: Error::ShuttingDown });
            }
            for &row in clients.keys() {
                engine.cancel(row);
            }
            deliver(&mut engine, &mut clients);
            continue;
        }
        // Requests cancelled while they wait end now, not when room frees up.
        waiting.retain(|s| {
            let cancelled = s.client_cancel.is_cancelled() || s.request.cancel.as_ref().is_some_and(CancelFlag::is_cancelled);
            if cancelled {
                let output = crate::batch::unopened_output(&s.request, FinishReason::Cancelled);
                let _ = s.events.send(RowEvent::Finished { row: 0, output });
            }
            !cancelled
        });
        while engine.len() < max_rows.min(MAX_ROWS) {
            let Some(next) = waiting.front() else { break };
            match engine.fits(&next.request) {
                Ok(true) => {}
                // First come, first served: the queue waits for rows to end.
                Ok(false) => break,
                Err(error) => {
                    let submission = waiting.pop_front().expect("front");
                    let _ = submission.events.send(RowEvent::Failed { row: 0, error });
                    continue;
                }
            }
            let submission = waiting.pop_front().expect("front");
            match engine.open(submission.request, submission.submitted) {
                Ok(row) => {
                    clients.insert(row, Client { events: submission.events, cancel: submission.client_cancel });
                }
                Err(error) => {
                    let _ = submission.events.send(RowEvent::Failed { row: 0, error });
                }
            }
        }
        engine.cancel_flagged();
        for (&row, client) in &clients {
            if client.cancel.is_cancelled() {
                engine.cancel(row);
            }
        }
        engine.submit();
        if let Some((row, chunk)) = engine.next_prefill() {
            engine.prefill(row, chunk);
        }
        deliver(&mut engine, &mut clients);
    }
}

/// Sends this step's events to their clients; a client that went away
/// cancels its row.
fn deliver(engine: &mut BatchEngine, clients: &mut HashMap<RowId, Client>) {
    for event in engine.finish_rows() {
        let row = event.row();
        let last = matches!(event, RowEvent::Finished { .. } | RowEvent::Failed { .. });
        let delivered = clients.get(&row).map(|c| c.events.send(event).is_ok());
        if last {
            clients.remove(&row);
        } else if delivered == Some(false) {
            engine.cancel(row);
        }
    }
}
