//! `space exec` and `space attach`: stream events to stdout/stderr, forward stdin, PTY mode.

use std::io::Write;

use anyhow::{Result, bail};
use clap::Args;
use futures::StreamExt;
use space_api::{Client, EventStream, ExecEvent, ExecRequest};
use tokio::io::AsyncReadExt;

#[derive(Debug, Args)]
pub struct ExecArgs {
    pub id: String,
    /// Environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = crate::parse_kv)]
    pub env: Vec<(String, String)>,
    /// Working directory inside the sandbox.
    #[arg(long, short = 'w')]
    pub cwd: Option<String>,
    /// User name or uid.
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// Forward stdin (closed at EOF).
    #[arg(short = 'i', long = "interactive")]
    pub interactive: bool,
    /// Run under a PTY; the local terminal goes raw and window changes are forwarded.
    #[arg(short = 't', long = "tty")]
    pub tty: bool,
    /// Start in the background and print the pid.
    #[arg(short = 'd', long = "detach")]
    pub detach: bool,
    #[arg(long)]
    pub tag: Option<String>,
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub cmd: Vec<String>,
}

/// Puts the terminal on fd 0 in raw mode; restores it when dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> Option<Self> {
        let stdin = std::io::stdin();
        if !rustix::termios::isatty(&stdin) {
            return None;
        }
        let saved = rustix::termios::tcgetattr(&stdin).ok()?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw).ok()?;
        Some(Self { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.saved,
        );
    }
}

fn window_size() -> Option<(u16, u16)> {
    let ws = rustix::termios::tcgetwinsize(std::io::stdout())
        .or_else(|_| rustix::termios::tcgetwinsize(std::io::stdin()))
        .ok()?;
    (ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

pub async fn run(client: Client, a: ExecArgs) -> Result<i32> {
    let forward_stdin = a.interactive || a.tty;
    let size = if a.tty { window_size() } else { None };
    let req = ExecRequest {
        cmd: a.cmd,
        env: a.env.into_iter().collect(),
        cwd: a.cwd,
        user: a.user,
        tty: a.tty,
        rows: size.map(|s| s.0),
        cols: size.map(|s| s.1),
        stdin: forward_stdin && !a.detach,
        stdin_data: None,
        tag: a.tag,
        background: a.detach,
    };
    if a.detach {
        let pid = client.exec_background(&a.id, &req).await?;
        println!("{pid}");
        return Ok(0);
    }
    let events = client.exec(&a.id, &req).await?;
    let raw = if a.tty { RawMode::enter() } else { None };
    let ctx = forward_stdin.then(|| Forward {
        client: client.clone(),
        id: a.id.clone(),
        tty: a.tty,
    });
    let code = print_events(events, ctx).await;
    drop(raw);
    code
}

/// What to forward once the process's pid is known.
pub struct Forward {
    client: Client,
    id: String,
    tty: bool,
}

impl Forward {
    fn start(self, pid: u32) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        let (client, id) = (self.client.clone(), self.id.clone());
        tasks.push(tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match stdin.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let data = bytes::Bytes::copy_from_slice(&buf[..n]);
                        if client.write_stdin(&id, pid, data).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = client.close_stdin(&id, pid).await;
        }));
        if self.tty {
            let (client, id) = (self.client, self.id);
            tasks.push(tokio::spawn(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let Ok(mut winch) = signal(SignalKind::window_change()) else {
                    return;
                };
                while winch.recv().await.is_some() {
                    if let Some((rows, cols)) = window_size() {
                        let _ = client.resize(&id, pid, rows, cols).await;
                    }
                }
            }));
        }
        tasks
    }
}

/// Writes output events to stdout/stderr as they arrive; returns the exit status
/// (code, or 128 + signal).
pub async fn print_events(mut events: EventStream, forward: Option<Forward>) -> Result<i32> {
    let mut forward = forward;
    let mut tasks = Vec::new();
    let result = loop {
        let Some(ev) = events.next().await else {
            break Err(anyhow::anyhow!(
                "the event stream ended before the process exited (unavailable)"
            ));
        };
        match ev? {
            ExecEvent::Started { pid } => {
                if let Some(f) = forward.take() {
                    tasks = f.start(pid);
                }
            }
            ExecEvent::Stdout { data, .. } | ExecEvent::Pty { data, .. } => {
                let mut out = std::io::stdout().lock();
                out.write_all(&data)?;
                out.flush()?;
            }
            ExecEvent::Stderr { data, .. } => {
                let mut err = std::io::stderr().lock();
                err.write_all(&data)?;
                err.flush()?;
            }
            ExecEvent::Gap { from, to } => {
                eprintln!("[space: {} bytes of output were dropped]", to - from);
            }
            ev @ ExecEvent::Exit { .. } => break Ok(ev.exit_status().unwrap_or(0)),
            ExecEvent::Error { code, message } => {
                bail!("{message} ({code})")
            }
        }
    };
    for t in tasks {
        t.abort();
    }
    result
}
