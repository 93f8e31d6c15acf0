//! Generation on a background thread, consumed as an iterator of events:
//! the shape bindings need (Python iterators, JS async iterators).

use crossbeam_channel::Receiver;

use crate::batch::RowEvent;
use crate::error::Error;
use crate::generate::{CancelFlag, Engine, GenerationOutput, GenerationRequest};
use crate::sampling::TokenLogprobs;

/// One event of a [`GenerationStream`].
#[derive(Debug)]
pub enum StreamEvent {
    /// A piece of text (complete UTF-8), the token that completed it, and
    /// the logprobs of the tokens since the previous piece (when asked for).
    Piece { text: String, token: u32, logprobs: Vec<TokenLogprobs> },
    /// The generation ended; `text` and `tokens` hold the whole output.
    Done(GenerationOutput),
    /// The generation failed.
    Failed(Error),
}

/// A generation consumed as an iterator: pieces, then one `Done` or
/// `Failed`. It runs as a row of the engine's batch on the scheduler thread;
/// dropping the stream cancels the row, which ends within one step, so no
/// generation outlives its stream.
///
/// Thread safety: the stream is `Send`; [`cancel_flag`](Self::cancel_flag)
/// may be used from any thread.
pub struct GenerationStream {
    /// Keeps the scheduler (and the model) alive while the stream is.
    _engine: Engine,
    events: Receiver<RowEvent>,
    cancel: CancelFlag,
    finished: bool,
    /// A request that failed before it was queued.
    early: Option<Error>,
}

impl GenerationStream {
    /// Queues `request`. The request's cancel flag (or a new one) is shared
    /// with the stream.
    pub fn start(engine: &Engine, mut request: GenerationRequest) -> GenerationStream {
        let cancel = request.cancel.get_or_insert_with(CancelFlag::new).clone();
        match engine.submit(&request, cancel.clone()) {
            Ok(events) => GenerationStream { _engine: engine.clone(), events, cancel, finished: false, early: None },
            Err(error) => GenerationStream {
                _engine: engine.clone(),
                events: crossbeam_channel::never(),
                cancel,
                finished: false,
                early: Some(error),
            },
        }
    }

    pub fn cancel_flag(&self) -> &CancelFlag {
        &self.cancel
    }

    fn convert(&mut self, event: RowEvent) -> StreamEvent {
        let event = match event {
            RowEvent::Piece { text, token, logprobs, .. } => StreamEvent::Piece { text, token, logprobs },
            RowEvent::Finished { output, .. } => StreamEvent::Done(output),
            RowEvent::Failed { error, .. } => StreamEvent::Failed(error),
        };
        self.finished = !matches!(event, StreamEvent::Piece { .. });
        event
    }

    /// Waits up to `timeout` for the next event; `Ok(None)` on timeout, so a
    /// caller can poll for interrupts (e.g. Python's Ctrl-C) between waits.
    pub fn next_timeout(&mut self, timeout: std::time::Duration) -> Result<Option<StreamEvent>, ()> {
        if self.finished {
            return Err(());
        }
        if let Some(error) = self.early.take() {
            self.finished = true;
            return Ok(Some(StreamEvent::Failed(error)));
        }
        match self.events.recv_timeout(timeout) {
            Ok(event) => Ok(Some(self.convert(event))),
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
        if let Some(error) = self.early.take() {
            self.finished = true;
            return Some(StreamEvent::Failed(error));
        }
        match self.events.recv() {
            Ok(event) => Some(self.convert(event)),
            Err(_) => {
                self.finished = true;
                None
            }
        }
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        // The scheduler ends the row at its next step.
        self.cancel.cancel();
    }
}
