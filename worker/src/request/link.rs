//! The worker's end of its socketpair with the supervisor (fd 3): the [`WorkerMessage`] lines
//! it writes (warming, ready, draining, loads on demand), and the questions it asks about what
//! only the supervisor knows (Triton's statistics of the whole pool and the repository index,
//! served on the main port), each answered by an [`Answer`] line with the question's id.
//!
//! The answers are read by a thread of their own, `inferd-answers`, started at the first
//! question: a worker that is never asked has no such thread.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use inferd_ipc::spec::WorkerMessage;
use inferd_ipc::triton::{Answer, Answered, IndexEntry, ModelStats, Question, Refused};
use tokio::sync::oneshot;
use tracing::warn;

/// How long a question waits for its answer: the supervisor answers from memory (the index
/// reads the repository's folders), in milliseconds unless it is stopping.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);

type Waiting = HashMap<u64, oneshot::Sender<Result<Answered, Refused>>>;

pub struct Link {
    /// Written under the lock, one line at a time; a 1 s write timeout keeps a stopped
    /// supervisor from blocking the worker (writes are small, and the supervisor reads
    /// continuously).
    stream: Mutex<UnixStream>,
    waiting: Arc<Mutex<Waiting>>,
    next: AtomicU64,
    /// The answers' reader, once started; the error why it could not be.
    reader: OnceLock<Result<(), String>>,
}

/// Why a question got no answer.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    /// The supervisor answered no (an unknown model or version).
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error("the supervisor did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the supervisor cannot be asked now: {0}")]
    Unreachable(String),
    /// An answer to another question: a supervisor of another build.
    #[error("the supervisor answered another question: {0:?}")]
    Mismatched(Answered),
}

impl Link {
    pub fn new(stream: UnixStream) -> Link {
        let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
        Link { stream: Mutex::new(stream), waiting: Arc::default(), next: AtomicU64::new(1), reader: OnceLock::new() }
    }

    /// Writes `message` (a failure is logged: the supervisor may be gone).
    pub fn send(&self, message: &WorkerMessage) {
        if let Err(e) = self.write(message) {
            warn!("cannot report to the supervisor: {e}");
        }
    }

    fn write(&self, message: &WorkerMessage) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(message).expect("messages serialise");
        line.push(b'\n');
        self.stream.lock().unwrap_or_else(|p| p.into_inner()).write_all(&line)
    }

    /// Triton's statistics of every model the pool serves, or of one (of one version).
    pub async fn statistics(&self, model: Option<&str>, version: Option<&str>) -> Result<Vec<ModelStats>, AskError> {
        let question = Question::Statistics { model: model.map(str::to_string), version: version.map(str::to_string) };
        match self.ask(question, Some(ASK_TIMEOUT)).await? {
            Answered::Statistics(stats) => Ok(stats),
            other => Err(AskError::Mismatched(other)),
        }
    }

    /// Triton's repository index; with `ready`, only the models that can be served now.
    pub async fn index(&self, ready: bool) -> Result<Vec<IndexEntry>, AskError> {
        match self.ask(Question::Index { ready }, Some(ASK_TIMEOUT)).await? {
            Answered::Index(entries) => Ok(entries),
            other => Err(AskError::Mismatched(other)),
        }
    }

    /// Triton's repository `load` (`load` true, as `asked`: its folder, its settings) or `unload` of
    /// `model`: answered once every worker runs the new model list, however long the rolling
    /// reload takes (the supervisor always ends it: done, refused or failed).
    pub async fn change_repository(
        &self,
        model: &str,
        load: bool,
        asked: inferd_ipc::triton::LoadParameters,
    ) -> Result<String, AskError> {
        let model = model.to_string();
        let question = match load {
            true => Question::Load { model, path: asked.path, config: asked.config },
            false => Question::Unload { model },
        };
        match self.ask(question, None).await? {
            Answered::Done(message) => Ok(message),
            other => Err(AskError::Mismatched(other)),
        }
    }

    /// Asks the supervisor `question` and waits for its answer, at most `timeout`.
    async fn ask(&self, question: Question, timeout: Option<Duration>) -> Result<Answered, AskError> {
        self.reader.get_or_init(|| self.start_reader()).clone().map_err(AskError::Unreachable)?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().unwrap_or_else(|p| p.into_inner()).insert(id, tx);
        let forget = || self.waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
        if let Err(e) = self.write(&WorkerMessage::Ask { id, question }) {
            forget();
            return Err(AskError::Unreachable(e.to_string()));
        }
        let answer = match timeout {
            None => Ok(rx.await),
            Some(timeout) => tokio::time::timeout(timeout, rx).await.map_err(|_| timeout),
        };
        match answer {
            Ok(Ok(answer)) => Ok(answer?),
            Ok(Err(_)) => Err(AskError::Unreachable("the supervisor closed the socket".into())),
            Err(timeout) => {
                forget();
                Err(AskError::Timeout(timeout))
            }
        }
    }

    /// The thread that reads the answers and hands each to its question. At the socket's end
    /// (the supervisor is gone) every question still waiting is dropped: it fails at once.
    fn start_reader(&self) -> Result<(), String> {
        let stream = self.stream.lock().unwrap_or_else(|p| p.into_inner()).try_clone().map_err(|e| e.to_string())?;
        let waiting = self.waiting.clone();
        let read = move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Answer>(&line) {
                    Ok(Answer { id, result }) => {
                        if let Some(question) = waiting.lock().unwrap_or_else(|p| p.into_inner()).remove(&id) {
                            let _ = question.send(result);
                        }
                    }
                    Err(e) => warn!("the supervisor sent an unreadable answer ({e}): {line}"),
                }
            }
            waiting.lock().unwrap_or_else(|p| p.into_inner()).clear();
        };
        std::thread::Builder::new().name("inferd-answers".into()).spawn(read).map(drop).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A question goes out as an `Ask` line, and the answer with its id comes back to it;
    /// a refusal is the question's error; the supervisor's end closing fails what waits.
    #[tokio::test]
    async fn questions_get_their_answers() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let link = Link::new(ours);
        let supervisor = std::thread::spawn(move || {
            let mut lines = BufReader::new(theirs.try_clone().unwrap()).lines();
            let mut write = theirs;
            for n in 0..2 {
                let line = lines.next().unwrap().unwrap();
                let WorkerMessage::Ask { id, question } = serde_json::from_str(&line).unwrap() else {
                    panic!("{line}")
                };
                let result = match (n, question) {
                    (0, Question::Index { ready: true }) => Ok(Answered::Index(vec![])),
                    (1, Question::Statistics { model: Some(name), .. }) => {
                        Err(Refused::UnknownModel { name, served: vec!["m".into()] })
                    }
                    other => panic!("{other:?}"),
                };
                let mut answer = serde_json::to_vec(&Answer { id, result }).unwrap();
                answer.push(b'\n');
                write.write_all(&answer).unwrap();
            }
        });
        assert_eq!(link.index(true).await.unwrap(), vec![]);
        let refused = link.statistics(Some("x"), None).await.unwrap_err();
        assert!(refused.to_string().contains("unknown model: 'x'"), "{refused}");
        supervisor.join().unwrap();
        let gone = link.index(false).await.unwrap_err();
        assert!(matches!(gone, AskError::Unreachable(_)), "{gone}");
    }
}
