//! Generation on a background thread, consumed as an iterator of events:
//! the shape bindings need (Python iterators, JS async iterators).

use crossbeam_channel::{bounded, Receiver};

use crate::error::Error;
use crate::generate::{CancelFlag, Engine, GenerationOutput, GenerationRequest};

/// One event of a [`GenerationStream`].
#[derive(Debug)]
pub enum StreamEvent {
    /// A piece of text (complete UTF-8) and the token that completed it.
    Piece { text: String, token: u32 },
    /// The generation ended; `text` and `tokens` hold the whole output.
    Done(GenerationOutput),
    /// The generation failed.
    Failed(Error),
}

/// A generation running on its own thread. Iterating yields pieces, then one
/// `Done` or `Failed`. Dropping the stream cancels the generation and waits
/// for its thread (one prefill chunk or decode step at most), so no
/// generation outlives its stream.
///
/// Thread safety: the stream is `Send`; [`cancel_flag`](Self::cancel_flag)
/// may be used from any thread.
pub struct GenerationStream {
    events: Receiver<StreamEvent>,
    cancel: CancelFlag,
    finished: bool,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl GenerationStream {
    /// Starts `request` on a new thread. The request's cancel flag (or a new
    /// one) is shared with the stream.
    pub fn start(engine: &Engine, mut request: GenerationRequest) -> GenerationStream {
        let cancel = request.cancel.get_or_insert_with(CancelFlag::new).clone();
        let (sender, events) = bounded(64);
        let engine = engine.clone();
        let worker = std::thread::spawn(move || {
            let result = engine.generate(&request, |piece| {
                sender.send(StreamEvent::Piece { text: piece.text.to_string(), token: piece.token }).is_ok()
            });
            let _ = sender.send(match result {
                Ok(output) => StreamEvent::Done(output),
                Err(e) => StreamEvent::Failed(e),
            });
        });
        GenerationStream { events, cancel, finished: false, worker: Some(worker) }
    }

    pub fn cancel_flag(&self) -> &CancelFlag {
        &self.cancel
    }

    /// Waits up to `timeout` for the next event; `Ok(None)` on timeout, so a
    /// caller can poll for interrupts (e.g. Python's Ctrl-C) between waits.
    pub fn next_timeout(&mut self, timeout: std::time::Duration) -> Result<Option<StreamEvent>, ()> {
        if self.finished {
            return Err(());
        }
        match self.events.recv_timeout(timeout) {
            Ok(event) => {
                self.finished = !matches!(event, StreamEvent::Piece { .. });
                Ok(Some(event))
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(None),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                self.finished = true;
                Err(())
            }
        }
    }
}

impl Iterator for GenerationStream {
    type Item = StreamEvent;

    fn next(&mut self) -> Option<StreamEvent> {
        if self.finished {
            return None;
        }
        let event = self.events.recv().ok();
        self.finished = !matches!(event, Some(StreamEvent::Piece { .. }));
        event
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        self.cancel.cancel();
        // Dropping the receiver makes a blocked send fail, so the worker stops.
        self.events = crossbeam_channel::never();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
