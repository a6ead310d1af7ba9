//! The fuzz targets' ways into space-node (fuzz/, docs/FUZZING.md): the first bytes of a
//! sandbox's connection as the egress proxy reads them ([`sniff`]), and DNS as a slot's server
//! judges a sandbox's query and screens the upstream's answer ([`dns`]). Both take bytes a
//! sandbox (or whoever answers its DNS) chose. Unit tests replay the committed corpus.

use std::net::Ipv4Addr;
use std::sync::OnceLock;

use hickory_proto::op::Message;
use hickory_proto::rr::RData;
use space_node_api::net::{Egress, NetworkSpec};
use space_node_api::policy::Policy;

use crate::net::dns::{self, Screened, Verdict};
use crate::net::proxy::sniff::{self as sn, Sniff};

/// The first byte picks where the connection is cut (a prefix of the rest): what the proxy
/// decided from the prefix, it decides from the whole; a name it reports is a normalized DNS
/// name.
pub fn sniff(data: &[u8]) {
    let Some((&cut, buf)) = data.split_first() else {
        return;
    };
    let whole = sn::sniff(buf);
    if let Sniff::Done { name: Some(n), .. } = &whole {
        assert_eq!(
            sn::normalize_host(n.as_bytes()).as_deref(),
            Some(n.as_str())
        );
        assert!(!n.ends_with('.') && n.bytes().all(|b| !b.is_ascii_uppercase()));
    }
    let prefix = &buf[..buf.len() * usize::from(cut) / 255];
    let early = sn::sniff(prefix);
    if matches!(early, Sniff::Done { .. }) {
        assert_eq!(
            early,
            whole,
            "decided on {} of {} bytes",
            prefix.len(),
            buf.len()
        );
    }
    let (proto, name) = sn::give_up(buf);
    assert!(name.is_none(), "{proto:?}");
}

fn policies() -> &'static [Policy; 2] {
    static P: OnceLock<[Policy; 2]> = OnceLock::new();
    P.get_or_init(|| {
        let reserved = ["10.213.0.0/16".parse().expect("a subnet")];
        let spec = |egress, allow: &[&str]| NetworkSpec {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        };
        [
            Policy::new(
                &spec(Egress::Allowlist, &["example.com", "*.allowed.test"]),
                &reserved,
            )
            .expect("an allowlist"),
            Policy::new(&spec(Egress::Open, &[]), &reserved).expect("open egress"),
        ]
    })
}

/// First byte: the policy (bit 0) and, with the next, the length of the query; the query, then
/// the upstream's answer. A refused name is never forwarded; a screened answer holds only A
/// records of the name asked (or its CNAMEs) that the policy allows after resolution, no AAAA,
/// no address in the additional section, and the addresses an allowlist admits are exactly its
/// A records.
pub fn dns(data: &[u8]) {
    let [p, hi, lo, rest @ ..] = data else {
        return;
    };
    let policy = &policies()[usize::from(p & 1)];
    let qlen = usize::from(u16::from_be_bytes([*hi, *lo])).min(rest.len());
    let (query, upstream) = rest.split_at(qlen);
    let (req, name) = match dns::judge(query, policy) {
        Verdict::Forward { req, name } => (req, name),
        Verdict::Refused { name, .. } => {
            assert!(!policy.allows_name(&name));
            return;
        }
        Verdict::Reply(_) => return,
    };
    assert!(policy.allows_name(&name));
    let Some(Screened { answer, admit }) = dns::screen(&req, &name, upstream, policy) else {
        return;
    };
    let m = Message::from_vec(&answer).expect("a screened answer parses");
    assert_eq!(m.metadata.id, req.metadata.id);
    let a: Vec<(Ipv4Addr, u32)> = m
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some((a.0, r.ttl)),
            _ => None,
        })
        .collect();
    for (ip, _) in &a {
        assert!(policy.allows_resolved_ip(*ip), "{ip} reached the sandbox");
    }
    assert!(!m.answers.iter().any(|r| matches!(r.data, RData::AAAA(_))));
    assert!(
        !m.additionals
            .iter()
            .any(|r| matches!(r.data, RData::A(_) | RData::AAAA(_)))
    );
    // Re-encoding may not round-trip every record exactly (hickory normalizes some), so the
    // admitted set is compared with what the sandbox is told, in order.
    assert_eq!(admit, a);
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_sniff_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("sniff", super::sniff);
        assert!(n >= 4, "only {n} inputs in fuzz/corpus/sniff");
    }

    #[test]
    fn the_dns_corpus_runs_clean() {
        let n = space_proto::fuzz_corpus::replay("dns", super::dns);
        assert!(n >= 4, "only {n} inputs in fuzz/corpus/dns");
    }
}
