//! Connections: the accept loop, a cap on open connections, timeouts for clients that send
//! slowly or not at all, and a shutdown that ends within a grace period.
//!
//! hyper serves each connection (HTTP/1.1 with keep-alive). Its header read timeout starts
//! whenever a connection waits for a request head, so it bounds a half-sent head and an idle
//! keep-alive connection alike; the body's timeout is the handlers' (`routes::read_body`).
//! What hyper does not do is here: at the cap a new connection closes the oldest connection
//! that has no request running (an idle or slow client, never a generation), so that a burst
//! of idle connections cannot keep `/health` or a real request out; and the shutdown stops
//! accepting, asks every connection to finish, and drops whatever is left when the grace
//! period ends or a second signal comes, so a client that never finishes its request cannot
//! keep the process alive.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc, watch};

/// Connection limits and the shutdown's grace period.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// Open connections at most; past it the oldest one without a running request closes.
    pub max_connections: usize,
    /// Time a connection has to send a whole request head, counted from when it starts
    /// waiting for one (so an idle keep-alive connection closes after it too).
    pub header_timeout: Duration,
    /// Time a request has to send its whole body (413/408 otherwise: `routes::read_body`).
    pub body_timeout: Duration,
    /// After the first SIGTERM or ctrl-c: time the open connections have to finish.
    pub shutdown_grace: Duration,
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// How the serving ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every connection finished within the grace period.
    Graceful,
    /// Connections were still open at the end of the grace period, or a second signal
    /// came: they were dropped.
    Forced,
}

/// An open connection, as the cap sees it.
struct Conn {
    peer: SocketAddr,
    opened: Instant,
    /// Requests of this connection inside the router or streaming their answer.
    busy: Arc<AtomicUsize>,
    /// Closes the connection (the cap's eviction).
    close: Arc<Notify>,
}

/// The open connections, oldest first.
#[derive(Default)]
struct Conns {
    map: Mutex<BTreeMap<u64, Conn>>,
}

impl Conns {
    fn len(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// Closes the oldest connection with no request running; its peer and age, or `None`
    /// when every connection is busy.
    fn evict_oldest_idle(&self) -> Option<(SocketAddr, Duration)> {
        let mut map = self.map.lock().ok()?;
        let id = map
            .iter()
            .find(|(_, c)| c.busy.load(Ordering::Acquire) == 0)
            .map(|(&id, _)| id)?;
        let conn = map.remove(&id)?;
        // `notify_one` keeps a permit when the task is not waiting yet: it closes anyway.
        conn.close.notify_one();
        Some((conn.peer, conn.opened.elapsed()))
    }
}

/// Messages about the cap and accept errors, at most one a second (a flood of connections
/// must not become a flood of log lines), each saying how many it stands for.
struct RateLimitedLog {
    last: Option<Instant>,
    suppressed: usize,
}

impl RateLimitedLog {
    fn log(&mut self, message: &dyn Fn() -> String) {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            self.suppressed += 1;
            return;
        }
        let more = std::mem::take(&mut self.suppressed);
        if more > 0 {
            eprintln!("{} ({more} more like it in the last second)", message());
        } else {
            eprintln!("{}", message());
        }
        self.last = Some(now);
    }
}

/// SIGTERM and ctrl-c (SIGINT), each one as it comes (a second one forces the end). The
/// handlers are installed before this returns: a signal sent as soon as the server says
/// it listens is caught, not the default action that kills the process.
pub fn signals() -> mpsc::UnboundedReceiver<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        for kind in [SignalKind::terminate(), SignalKind::interrupt()] {
            let Ok(mut s) = signal(kind) else {
                continue;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                while s.recv().await.is_some() {
                    if tx.send(()).is_err() {
                        return;
                    }
                }
            });
        }
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    rx
}

/// Serves `router` on `listener` until the first message on `signals`, then ends as
/// `NetConfig::shutdown_grace` says.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    config: &NetConfig,
    mut signals: mpsc::UnboundedReceiver<()>,
) -> Ending {
    let conns = Arc::new(Conns::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    // One log for the accept loop and every connection: the limit holds for them all.
    let log = Arc::new(Mutex::new(RateLimitedLog {
        last: None,
        suppressed: 0,
    }));
    let say = |message: &dyn Fn() -> String| {
        if let Ok(mut l) = log.lock() {
            l.log(message);
        }
    };
    let cap = config.max_connections.max(1);
    let mut next_id = 0u64;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = signals.recv() => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors (EMFILE) most likely: free one held by an idle client,
                // and give the others a moment.
                let freed = conns.evict_oldest_idle();
                say(&|| {
                    format!(
                        "cannot accept a connection ({e}; {} open){}",
                        conns.len(),
                        freed.map_or(String::new(), |(p, _)| format!(
                            ": closed the oldest idle one, from {p}"
                        ))
                    )
                });
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if conns.len() >= cap {
            match conns.evict_oldest_idle() {
                Some((old, age)) => say(&|| {
                    format!(
                        "connection cap of {cap} reached (--max-connections): closed the \
                         oldest idle connection, from {old} (open {:.1} s), for one from {peer}",
                        age.as_secs_f64()
                    )
                }),
                None => {
                    say(&|| {
                        format!(
                            "connection cap of {cap} reached (--max-connections) and every \
                             connection has a request running: refused one from {peer}"
                        )
                    });
                    drop(stream);
                    continue;
                }
            }
        }
        let busy = Arc::new(AtomicUsize::new(0));
        let close = Arc::new(Notify::new());
        let id = next_id;
        next_id += 1;
        if let Ok(mut map) = conns.map.lock() {
            map.insert(
                id,
                Conn {
                    peer,
                    opened: Instant::now(),
                    busy: Arc::clone(&busy),
                    close: Arc::clone(&close),
                },
            );
        }
        let conn = Connection {
            router: router.clone(),
            peer,
            log: Arc::clone(&log),
            header_timeout: config.header_timeout,
            busy,
            close,
            stop: stop_rx.clone(),
        };
        let conns = Arc::clone(&conns);
        tokio::spawn(async move {
            conn.run(stream).await;
            if let Ok(mut map) = conns.map.lock() {
                map.remove(&id);
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let deadline = tokio::time::Instant::now() + config.shutdown_grace;
    loop {
        let open = conns.len();
        if open == 0 {
            return Ending::Graceful;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = tokio::time::sleep_until(deadline) => {
                eprintln!(
                    "shutdown: {open} connection(s) still open after the grace period of \
                     {:.1} s (--shutdown-grace): closed",
                    config.shutdown_grace.as_secs_f64()
                );
                return Ending::Forced;
            }
            _ = signals.recv() => {
                eprintln!("shutdown: a second signal: closing {open} connection(s) now");
                return Ending::Forced;
            }
        }
    }
}

/// One connection's task.
struct Connection {
    router: Router,
    peer: SocketAddr,
    log: Arc<Mutex<RateLimitedLog>>,
    header_timeout: Duration,
    busy: Arc<AtomicUsize>,
    close: Arc<Notify>,
    stop: watch::Receiver<bool>,
}

impl Connection {
    async fn run(mut self, stream: tokio::net::TcpStream) {
        let router = self.router.clone();
        let busy = Arc::clone(&self.busy);
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let router = router.clone();
            let guard = Busy::new(&busy);
            async move {
                let response =
                    tower::ServiceExt::oneshot(router, request.map(axum::body::Body::new)).await;
                // The connection stays busy while the answer streams: a guard in its body.
                response.map(|r| {
                    r.map(|body| {
                        let stream = body.into_data_stream();
                        axum::body::Body::from_stream(tokio_stream::StreamExt::map(
                            stream,
                            move |piece| {
                                let _ = &guard;
                                piece
                            },
                        ))
                    })
                })
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout);
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        tokio::pin!(connection);
        let mut stopping = false;
        loop {
            if !stopping && *self.stop.borrow_and_update() {
                // Closes at once when idle, else after the request in progress.
                connection.as_mut().graceful_shutdown();
                stopping = true;
            }
            tokio::select! {
                served = connection.as_mut() => {
                    if served.as_ref().is_err_and(hyper::Error::is_timeout)
                        && let Ok(mut log) = self.log.lock()
                    {
                        log.log(&|| {
                            format!(
                                "closed a connection from {}: no whole request head within \
                                 {:.1} s (idle or slow; --header-timeout)",
                                self.peer,
                                self.header_timeout.as_secs_f64()
                            )
                        });
                    }
                    return;
                }
                _ = self.close.notified() => return,
                changed = self.stop.changed(), if !stopping => {
                    if changed.is_err() {
                        stopping = true;
                    }
                }
            }
        }
    }
}

/// Counts a request as running on its connection while it lives.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
