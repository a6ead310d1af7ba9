//! `space net`, `space port` and `space secret` (decision 0012).

use std::io::Read;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use space_api::{Client, Egress, NetworkPolicy, PutSecret, Sandbox, SecretList};

#[derive(Debug, Args)]
pub struct NetArgs {
    id: String,
    /// Replace the policy: none, allowlist or open (default with --allow: allowlist).
    #[arg(long, value_name = "MODE")]
    egress: Option<Egress>,
    /// Allow rule (repeatable): CIDR, address, domain or *.domain, then :PORTS (443,
    /// 8000-8100 or *; default 80 and 443). Replaces all rules.
    #[arg(long = "allow", value_name = "RULE")]
    allow: Vec<String>,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct PortArgs {
    id: String,
    /// A TCP port the sandbox listens on (1-65535).
    #[arg(value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
}

#[derive(Debug, Subcommand)]
pub enum SecretCmd {
    /// Create or replace a secret; the value is read from stdin (one trailing newline is
    /// dropped).
    Set {
        name: String,
        /// Host the value may be sent to (repeatable): api.example.com or *.example.com.
        #[arg(long = "host", required = true, value_name = "PATTERN")]
        hosts: Vec<String>,
        /// Header that carries it, {} where the value goes: 'Authorization: Bearer {}'.
        #[arg(long, value_name = "'NAME: TEMPLATE'")]
        header: String,
    },
    /// List secrets (never their values).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Delete a secret.
    Rm { name: String },
}

/// The policy of `--egress`/`--allow`, or None when neither is given.
pub fn policy_from_flags(egress: Option<Egress>, allow: &[String]) -> Option<NetworkPolicy> {
    (egress.is_some() || !allow.is_empty()).then(|| NetworkPolicy {
        egress,
        allow: allow.to_vec(),
    })
}

fn print_network(sb: &Sandbox) {
    let Some(n) = &sb.network else {
        println!("egress:  unknown");
        return;
    };
    println!("egress:  {}", n.egress);
    if n.allow.is_empty() {
        println!("allow:   -");
    } else {
        println!("allow:   {}", n.allow.join(" "));
    }
    println!("address: {}", n.address.as_deref().unwrap_or("-"));
    println!("gateway: {}", n.gateway.as_deref().unwrap_or("-"));
    if !sb.secrets.is_empty() {
        println!("secrets: {}", sb.secrets.join(" "));
    }
}

pub async fn run_net(c: Client, a: NetArgs) -> Result<i32> {
    let sb = match policy_from_flags(a.egress, &a.allow) {
        None => c.get_sandbox(&a.id).await?,
        Some(p) => c.set_network(&a.id, &p).await?,
    };
    if a.json {
        crate::print_json(&sb.network)?;
    } else {
        print_network(&sb);
    }
    Ok(0)
}

pub async fn run_port(c: Client, a: PortArgs) -> Result<i32> {
    let p = c.open_port(&a.id, a.port).await?;
    println!("{}", p.url);
    Ok(0)
}

/// The value as given on stdin: one trailing "\n" (or "\r\n") dropped; empty is refused.
pub fn value_from_input(raw: &[u8]) -> Result<String> {
    let mut v = raw;
    if let Some(rest) = v.strip_suffix(b"\n") {
        v = rest.strip_suffix(b"\r").unwrap_or(rest);
    }
    if v.is_empty() {
        bail!(
            "empty secret value: pipe it on stdin (e.g. `printf %s \"$KEY\" | space secret set ...`)"
        );
    }
    String::from_utf8(v.to_vec()).context("the secret value is not UTF-8")
}

/// Reads the value: from a pipe whole; from a terminal one line, without echo.
fn read_value(name: &str) -> Result<String> {
    let stdin = std::io::stdin();
    if rustix::termios::isatty(&stdin) {
        eprint!("value of {name}: ");
        let saved = rustix::termios::tcgetattr(&stdin).ok();
        if let Some(saved) = &saved {
            let mut quiet = saved.clone();
            quiet.local_modes.remove(rustix::termios::LocalModes::ECHO);
            let _ =
                rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &quiet);
        }
        let mut line = String::new();
        let r = stdin.read_line(&mut line);
        if let Some(saved) = &saved {
            let _ =
                rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, saved);
        }
        eprintln!();
        r.context("cannot read the value from the terminal")?;
        return value_from_input(line.as_bytes());
    }
    let mut raw = Vec::new();
    stdin
        .lock()
        .take(64 * 1024)
        .read_to_end(&mut raw)
        .context("cannot read the value from stdin")?;
    value_from_input(&raw)
}

pub async fn run_secret(c: Client, cmd: SecretCmd) -> Result<i32> {
    match cmd {
        SecretCmd::Set {
            name,
            hosts,
            header,
        } => {
            let value = read_value(&name)?;
            let info = c
                .put_secret(
                    &name,
                    &PutSecret {
                        value,
                        hosts,
                        header,
                    },
                )
                .await?;
            println!("{}", info.name);
        }
        SecretCmd::Ls { json } => {
            let secrets = c.list_secrets().await?;
            if json {
                crate::print_json(&SecretList { secrets })?;
            } else {
                println!("{:<24}  {:<32}  {:<24}  HOSTS", "NAME", "HEADER", "UPDATED");
                for s in secrets {
                    println!(
                        "{:<24}  {:<32}  {:<24}  {}",
                        s.name,
                        s.header,
                        s.updated_at,
                        s.hosts.join(" ")
                    );
                }
            }
        }
        SecretCmd::Rm { name } => {
            c.delete_secret(&name).await?;
            println!("{name}");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_drop_one_newline_and_refuse_empty() {
        assert_eq!(value_from_input(b"sk-1\n").unwrap(), "sk-1");
        assert_eq!(value_from_input(b"sk-1\r\n").unwrap(), "sk-1");
        assert_eq!(value_from_input(b"sk-1\n\n").unwrap(), "sk-1\n");
        assert_eq!(value_from_input(b"sk-1").unwrap(), "sk-1");
        assert!(value_from_input(b"").is_err());
        assert!(value_from_input(b"\n").is_err());
        assert!(value_from_input(b"\xff\n").is_err());
    }

    #[test]
    fn flags_make_policies() {
        assert_eq!(policy_from_flags(None, &[]), None);
        let p = policy_from_flags(Some(Egress::None), &[]).unwrap();
        assert_eq!(p.egress, Some(Egress::None));
        let p = policy_from_flags(None, &["x.com".into()]).unwrap();
        assert_eq!((p.egress, p.allow.len()), (None, 1));
    }
}
