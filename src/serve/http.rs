//! The HTTP transport: the accept loop, and the bounds that keep clients that stall or
//! hoard connections from locking the server. axum's own `serve` gives hyper no timer (so no
//! header timeout applies) and no cap on connections; here, as nginx or llama-server would:
//! - at most `--max-connections` open at once (and fewer than the file limit, whose soft
//!   value is raised to the hard one at start); more wait in the kernel's backlog;
//! - a connection that sends no complete request head within `--header-timeout` (a silent
//!   one, or one idle between keep-alive requests) is closed;
//! - a request body that is not all there within `--body-timeout` is answered 408;
//! - the first SIGINT or SIGTERM stops accepting and lets running requests finish for at
//!   most `--shutdown-timeout`, then cancels what is left; a second signal cancels at once.

use super::error::ApiError;
use crate::error::{Error, Result};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::Semaphore;

/// The largest request body read (axum's default limit, 2 MiB).
pub const MAX_BODY: usize = 2 << 20;

/// The transport's bounds (the `serve` flags).
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub shutdown_timeout: Duration,
}

/// Serves `app` on `listener` until a signal, then drains (see the module's text).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: &Limits,
    cancel: Arc<AtomicBool>,
    mut signals: UnboundedReceiver<()>,
) -> Result<()> {
    let app = app.layer(middleware::from_fn_with_state(
        limits.body_timeout,
        read_body,
    ));
    let connections = Arc::new(Semaphore::new(connection_cap(limits.max_connections)));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    loop {
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => permit,
            _ = signal(&mut signals) => break,
        };
        let permit = permit.map_err(|e| Error::Serve(format!("connection limit: {e}")))?;
        let stream = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = signal(&mut signals) => break,
        };
        let stream = match stream {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it was accepted:
                // wait a little rather than spin.
                eprintln!("serve: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _ = connection.await;
            drop(permit);
        });
    }
    drop(listener);
    eprintln!(
        "shutting down: no new requests; running ones have {} s to finish (signal again to \
         cancel them)",
        limits.shutdown_timeout.as_secs_f64()
    );
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_timeout) => {
            eprintln!("cancelling running requests: --shutdown-timeout passed");
        }
        _ = signal(&mut signals) => eprintln!("cancelling running requests"),
    }
    // Whatever still runs ends at the scheduler's next step; connections still open are
    // dropped with the runtime.
    cancel.store(true, Ordering::Relaxed);
    Ok(())
}

/// Reads the whole body within `timeout` (408 if it does not come, 413 over [`MAX_BODY`]),
/// so that a handler never waits on a client that stalls mid-body.
async fn read_body(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Ok(Ok(bytes)) => bytes,
        // Over the limit (a client that went away gets no answer anyway).
        Ok(Err(_)) => return ApiError::too_large(MAX_BODY).into_response(),
        Err(_) => return ApiError::body_timed_out(timeout).into_response(),
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// `wanted`, but below the file limit (with room for the model's files and the runtime),
/// after raising the soft limit to the hard one.
fn connection_cap(wanted: usize) -> usize {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit on a valid rlimit struct.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            if lim.rlim_cur < lim.rlim_max {
                let raised = libc::rlimit {
                    rlim_cur: lim.rlim_max,
                    rlim_max: lim.rlim_max,
                };
                // SAFETY: as above.
                if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                    lim.rlim_cur = lim.rlim_max;
                }
            }
            let files = usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX);
            return wanted.min(files.saturating_sub(64).max(1));
        }
    }
    wanted
}

/// The next signal; never, when no handler could be installed (serve until killed).
async fn signal(signals: &mut UnboundedReceiver<()>) {
    if signals.recv().await.is_none() {
        std::future::pending::<()>().await;
    }
}

/// One message per SIGINT (Ctrl-C) or SIGTERM. On Unix the handlers are installed here,
/// before the caller prints its address, so that a signal sent as soon as it listens is one
/// of ours; elsewhere Ctrl-C's is installed when its task first runs.
pub fn signals() -> UnboundedReceiver<()> {
    let (tx, rx) = unbounded_channel();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        for kind in [SignalKind::interrupt(), SignalKind::terminate()] {
            if let Ok(mut sig) = signal(kind) {
                let tx = tx.clone();
                tokio::spawn(
                    async move { while sig.recv().await.is_some() && tx.send(()).is_ok() {} },
                );
            }
        }
    }
    #[cfg(not(unix))]
    tokio::spawn(
        async move { while tokio::signal::ctrl_c().await.is_ok() && tx.send(()).is_ok() {} },
    );
    rx
}
