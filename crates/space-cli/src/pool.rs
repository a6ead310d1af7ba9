//! `space pool ls|get|set`: warm pools of templates (decision 0013).

use anyhow::Result;
use clap::Subcommand;
use space_api::{Client, Pool, PoolList, SetPool};

#[derive(Debug, Subcommand)]
pub enum PoolCmd {
    /// List the templates' warm pools.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Show a template's warm pool.
    Get {
        template: String,
        #[arg(long)]
        json: bool,
    },
    /// Set a template's warm pool (--min 0 turns it off). Sizes beyond the node's capacity
    /// are clamped, with a warning on stderr.
    Set {
        template: String,
        /// Ready sandboxes kept at all times.
        #[arg(long)]
        min: u32,
        /// How far the pool may grow while creates outrun it (default: --min).
        #[arg(long)]
        max: Option<u32>,
        /// The runtime whose sandboxes are pooled (default: the node's).
        #[arg(long)]
        runtime: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

const HEADER: [&str; 9] = [
    "TEMPLATE", "RUNTIME", "MIN", "MAX", "TARGET", "READY", "STARTING", "HITS", "MISSES",
];

/// One table line: the template and runtime left-aligned, the numbers right-aligned.
fn line(cols: [String; 9]) -> String {
    let [t, r, rest @ ..] = cols;
    let nums: Vec<String> = rest
        .iter()
        .zip(&HEADER[2..])
        .map(|(v, h)| format!("{v:>w$}", w = h.len().max(6)))
        .collect();
    format!("{t:<20}  {r:<10}  {}", nums.join("  "))
}

/// The table of `space pool ls` (and `get`): a header and one line per pool.
pub fn table(pools: &[Pool]) -> String {
    let mut out = vec![line(HEADER.map(String::from))];
    for p in pools {
        out.push(line([
            p.template.clone(),
            p.runtime.clone(),
            p.min.to_string(),
            p.max.to_string(),
            p.target.to_string(),
            p.ready.to_string(),
            p.starting.to_string(),
            p.hits.to_string(),
            p.misses.to_string(),
        ]));
    }
    out.join("\n")
}

fn show(p: &Pool, json: bool) -> Result<()> {
    if json {
        crate::print_json(p)?;
    } else {
        println!("{}", table(std::slice::from_ref(p)));
    }
    Ok(())
}

pub async fn run(c: Client, cmd: PoolCmd) -> Result<i32> {
    match cmd {
        PoolCmd::Ls { json } => {
            let pools = c.list_pools().await?;
            if json {
                crate::print_json(&PoolList { pools })?;
            } else {
                println!("{}", table(&pools));
            }
        }
        PoolCmd::Get { template, json } => show(&c.get_pool(&template).await?, json)?,
        PoolCmd::Set {
            template,
            min,
            max,
            runtime,
            json,
        } => {
            let p = c
                .set_pool(&template, &SetPool { min, max, runtime })
                .await?;
            if let Some(w) = &p.warning {
                eprintln!("warning: {w}");
            }
            show(&p, json)?;
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_a_header_and_aligned_columns() {
        let p = Pool {
            template: "base".into(),
            runtime: "namespace".into(),
            min: 4,
            max: 32,
            target: 6,
            ready: 5,
            starting: 1,
            hits: 1234,
            misses: 2,
            warning: None,
        };
        let t = table(&[p]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        let head: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(head, HEADER);
        let row: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(
            row,
            ["base", "namespace", "4", "32", "6", "5", "1", "1234", "2"]
        );
        // Right-aligned numbers end under their headings.
        let end = |l: &str, w: &str| l.find(w).unwrap() + w.len();
        assert_eq!(end(lines[0], "MISSES"), lines[1].len());
        assert_eq!(end(lines[0], "HITS"), end(lines[1], "1234"));
        assert_eq!(table(&[]).lines().count(), 1);
    }
}
