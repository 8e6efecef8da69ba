//! The socket side of the server: accepting connections up to a bound,
//! serving HTTP/1.1 on each with hyper's header-read timeout (which also
//! closes idle keep-alive connections) and a write timeout for clients that
//! stop reading, counting requests in flight, and shutting down on SIGTERM
//! or Ctrl-C as soon as the last response is out: idle and half-sent
//! connections do not hold the process.

use crate::api::error::ApiError;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};

/// Connection and request counts, for `/metrics` and the shutdown.
#[derive(Debug, Default)]
pub struct ConnectionStats {
    open: AtomicUsize,
    pub(crate) accepted: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) timed_out: AtomicU64,
    in_flight: AtomicUsize,
    /// Notified when the last request in flight ends, and when the last connection closes.
    quiet: Notify,
}

impl ConnectionStats {
    /// Client connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Requests being answered now (from their headers until hyper has taken
    /// their response's last byte).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Resolves once `done` holds, checked whenever requests or connections drop to zero.
    async fn until(&self, done: impl Fn(&Self) -> bool) {
        loop {
            let changed = self.quiet.notified();
            if done(self) {
                return;
            }
            changed.await;
        }
    }
}

/// How the listener treats connections.
#[derive(Debug, Clone)]
pub struct Serving {
    /// Longest wait for a request's headers, from connect or from the last response.
    pub header_read_timeout: Duration,
    /// Longest a response may wait for the client to take more of it.
    pub write_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// After the signal, how long requests in flight may take to finish.
    pub grace: Duration,
    /// Counts shared with `/metrics`.
    pub stats: Arc<ConnectionStats>,
}

/// What one connection's task needs to know to close it at shutdown.
#[derive(Debug, Default)]
struct Connection {
    /// Requests on it being answered.
    requests: AtomicUsize,
    /// A write is waiting for the client to take bytes.
    writing: AtomicBool,
}

/// One request in flight; dropped with its response's body.
struct InFlight(Arc<ConnectionStats>, Option<Arc<Connection>>);

impl InFlight {
    fn new(stats: Arc<ConnectionStats>, connection: Option<Arc<Connection>>) -> InFlight {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        if let Some(c) = &connection {
            c.requests.fetch_add(1, Ordering::Relaxed);
        }
        InFlight(stats, connection)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(c) = &self.1 {
            c.requests.fetch_sub(1, Ordering::Relaxed);
        }
        if self.0.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.quiet.notify_waiters();
        }
    }
}

/// A response body that keeps its request counted until it is sent or dropped.
struct Tracked {
    body: axum::body::Body,
    _request: InFlight,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

async fn track(State(stats): State<Arc<ConnectionStats>>, request: Request, next: Next) -> Response {
    let connection = request.extensions().get::<Arc<Connection>>().cloned();
    let counted = InFlight::new(stats, connection);
    next.run(request).await.map(|body| axum::body::Body::new(Tracked { body, _request: counted }))
}

/// After the grace period, how long the responses cut short get to send
/// their last event.
const CUT_FLUSH: Duration = Duration::from_secs(1);

/// Most connections being refused at once; past it they are just closed.
const MAX_REFUSING: usize = 256;

/// Answers a connection over the bound and closes it: 503 with
/// `Retry-After`, except a liveness probe (`GET /health`), which is told the
/// process is alive so that a flood of connections does not get it
/// restarted. What the client sent is read (and discarded) for up to a
/// second, so that the close is not a reset that hides the answer.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut head = [0u8; 512];
        let read = tokio::time::timeout(Duration::from_millis(100), stream.read(&mut head)).await;
        let probe = matches!(read, Ok(Ok(n)) if head[..n].starts_with(b"GET /health "));
        let (status, body) = if probe {
            ("200 OK", "ok".to_string())
        } else {
            let error = ApiError::Unavailable("the server has too many open connections; retry shortly".into());
            ("503 Service Unavailable", error.body().to_string())
        };
        let kind = if probe { "text/plain; charset=utf-8" } else { "application/json" };
        let response = format!(
            "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\nretry-after: 1\r\nconnection: close\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<_, std::io::Error>(())
    })
    .await;
}

/// A connection whose writes fail once the client has taken nothing for
/// `limit`: a client that stops reading cannot hold its connection (and the
/// response waiting in it) for ever.
struct WriteTimeout {
    stream: TcpStream,
    limit: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    connection: Arc<Connection>,
}

impl WriteTimeout {
    fn guard<T>(&mut self, cx: &mut Context<'_>, poll: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        self.connection.writing.store(poll.is_pending(), Ordering::Relaxed);
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let limit = self.limit;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took nothing of the response for {limit:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteTimeout {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteTimeout {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, data);
        self.guard(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, data);
        self.guard(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.guard(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Takes one connection off the open count when its task ends.
struct Open(Arc<ConnectionStats>);

impl Drop for Open {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.quiet.notify_waiters();
        }
    }
}

/// Serves `router` on `listener` until `signal` resolves. Then `on_signal`
/// runs (the API starts draining), the listener closes, idle and half-sent
/// connections close, the others close after their response, and the call
/// returns as soon as every connection is closed. When `serving.grace` is
/// over first, `on_grace_over` runs (the API ends what still runs with an
/// error) and the call returns a second later at most.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    serving: Serving,
    signal: impl std::future::Future<Output = ()>,
    on_signal: impl FnOnce(),
    on_grace_over: impl FnOnce(),
) -> std::io::Result<()> {
    let stats = serving.stats.clone();
    let router = router.layer(axum::middleware::from_fn_with_state(stats.clone(), track));
    let permits = Arc::new(Semaphore::new(serving.max_connections));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let shutdown = tokio::sync::watch::Sender::new(false);
    let mut builder = hyper::server::conn::http1::Builder::new();
    // A request head larger than 64 KiB is refused (431), so a slow sender
    // pins at most that much until its header timeout.
    builder.timer(TokioTimer::new()).header_read_timeout(serving.header_read_timeout).max_buf_size(64 << 10);
    let mut signal = std::pin::pin!(signal);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: wait, then go on.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            if let Ok(refusing) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(refusing);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        stats.open.fetch_add(1, Ordering::Relaxed);
        let open = Open(stats.clone());
        let state = Arc::new(Connection::default());
        let io = WriteTimeout { stream, limit: serving.write_timeout, stalled: None, connection: state.clone() };
        let (router, tagged) = (router.clone(), state.clone());
        let service = hyper::service::service_fn(move |mut request: Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(tagged.clone());
            tower::ServiceExt::oneshot(router.clone(), request)
        });
        let connection = builder.serve_connection(TokioIo::new(io), service);
        let mut closing = shutdown.subscribe();
        let stats = stats.clone();
        tokio::spawn(async move {
            let (_permit, _open) = (permit, open);
            let mut connection = std::pin::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                _ = async { closing.wait_for(|closing| *closing).await.map(|_| ()) } => {
                    connection.as_mut().graceful_shutdown();
                    // Idle connections close now; one with a request being
                    // answered closes after its response; one holding only
                    // part of a request, or nothing at all, is dropped.
                    loop {
                        tokio::select! {
                            result = connection.as_mut() => break result,
                            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                                let quiet = state.requests.load(Ordering::Relaxed) == 0
                                    && !state.writing.load(Ordering::Relaxed);
                                if quiet {
                                    break Ok(());
                                }
                            }
                        }
                    }
                }
            };
            if let Err(e) = result
                && e.is_timeout()
            {
                stats.timed_out.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    on_signal();
    drop(listener);
    shutdown.send_replace(true);
    if tokio::time::timeout(serving.grace, stats.until(|s| s.open() == 0)).await.is_err() {
        tracing::warn!(
            "the shutdown grace period of {:?} is over; ending {} requests in flight on {} connections",
            serving.grace,
            stats.in_flight(),
            stats.open()
        );
        // Responses still running end with an error (streams with a last
        // event) rather than being cut mid-way; a second lets those out.
        on_grace_over();
        let _ = tokio::time::timeout(CUT_FLUSH, stats.until(|s| s.open() == 0)).await;
    }
    Ok(())
}

/// Binds `addr` with a listen backlog of `backlog` connections (the
/// kernel caps it at `net.core.somaxconn`): a burst of connects waits in
/// the backlog instead of being dropped and retried a second later.
pub async fn bind(addr: &str, backlog: u32) -> std::io::Result<TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host(addr).await? {
        let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        match socket.bind(addr).and_then(|()| socket.listen(backlog)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last
        .unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr} resolves to nothing"))))
}

/// Raises this process's soft limit on open files to its hard limit, so
/// that `max-connections` is not cut short by a default of 1024; returns
/// the limit in force.
pub fn raise_open_files_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit only read and write the struct passed.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return None;
            }
            if limit.rlim_cur < limit.rlim_max {
                let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    limit = raised;
                }
            }
        }
        Some(limit.rlim_cur)
    }
    #[cfg(not(unix))]
    None
}
