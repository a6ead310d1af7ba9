//! Egress rules: parsing (clear errors naming the bad rule) and matching, shared by the kernel
//! rules (CIDR sets), the DNS server (names) and the egress proxy (names and addresses).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::net::{Egress, NetworkSpec};

/// At most this many allow rules per sandbox.
pub const MAX_RULES: usize = 256;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("invalid allow rule {rule:?}: {reason}")]
    Rule { rule: String, reason: String },
    #[error("invalid host pattern {pattern:?}: {reason}")]
    HostPattern { pattern: String, reason: String },
    #[error("too many allow rules ({0}; at most {MAX_RULES})")]
    TooMany(usize),
    #[error("egress none takes no allow rules (got {0})")]
    RulesWithNone(usize),
}

/// One validated allow rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    Cidr(Ipv4Net),
    /// A lowercase domain name, matched exactly.
    Exact(String),
    /// `*.example.com`, stored as `example.com`: matches names strictly below it.
    Wildcard(String),
}

/// Whether `s` is a valid lowercase-able DNS name: labels of 1..=63 of [a-z0-9-], not starting
/// or ending with '-', total <= 253, at least two labels.
fn check_domain(s: &str) -> Result<String, String> {
    let name = s.trim_end_matches('.').to_ascii_lowercase();
    if name.is_empty() {
        return Err("empty name".into());
    }
    if name.len() > 253 {
        return Err("name longer than 253 characters".into());
    }
    let labels: Vec<&str> = name.split('.').collect();
    if labels.len() < 2 {
        return Err("a domain needs at least two labels (like example.com)".into());
    }
    for l in &labels {
        if l.is_empty() || l.len() > 63 {
            return Err("every label must have 1 to 63 characters".into());
        }
        if !l
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "label {l:?} may only hold letters, digits, '-' and '_'"
            ));
        }
        if l.starts_with('-') || l.ends_with('-') {
            return Err(format!("label {l:?} starts or ends with '-'"));
        }
    }
    if labels
        .last()
        .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err("looks like an IP address, not a domain".into());
    }
    Ok(name)
}

fn parse_domain_pattern(s: &str) -> Result<Rule, String> {
    if s == "*" {
        return Err("'*' would match every host; name the domains".into());
    }
    if let Some(rest) = s.strip_prefix("*.") {
        let base = check_domain(rest)?;
        return Ok(Rule::Wildcard(base));
    }
    if s.contains('*') {
        return Err("'*' is only allowed as the whole first label (*.example.com)".into());
    }
    Ok(Rule::Exact(check_domain(s)?))
}

/// Parses one allow rule: a CIDR (`203.0.113.0/24`), an IPv4 address (`/32`), an exact domain
/// or a wildcard domain.
pub fn parse_rule(s: &str) -> Result<Rule, PolicyError> {
    let err = |reason: String| PolicyError::Rule {
        rule: s.to_owned(),
        reason,
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(err("empty rule".into()));
    }
    let looks_numeric = t
        .bytes()
        .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/');
    if t.contains(':') {
        return Err(err("IPv6 is not supported; sandboxes are IPv4 only".into()));
    }
    if looks_numeric {
        let net = if t.contains('/') {
            t.parse::<Ipv4Net>()
                .map_err(|e| err(format!("not a valid IPv4 CIDR: {e}")))?
        } else {
            let ip = t
                .parse::<Ipv4Addr>()
                .map_err(|e| err(format!("not a valid IPv4 address: {e}")))?;
            Ipv4Net::new(ip, 32).expect("/32 is valid")
        };
        if net.trunc() != net {
            return Err(err(format!("host bits set; did you mean {}?", net.trunc())));
        }
        if net.prefix_len() == 0 {
            return Err(err(
                "0.0.0.0/0 allows everything; use egress open instead".into()
            ));
        }
        if net_overlaps_always_denied(&net) {
            return Err(err(
                "overlaps loopback, link-local/metadata (169.254.0.0/16), multicast or reserved \
                 ranges, which sandboxes can never reach"
                    .into(),
            ));
        }
        return Ok(Rule::Cidr(net));
    }
    parse_domain_pattern(t).map_err(err)
}

/// Parses a secret's host pattern: an exact or wildcard domain, never an address, never `*`
/// nor a wildcard over a top-level domain (`*.com`).
pub fn parse_host_pattern(s: &str) -> Result<Rule, PolicyError> {
    let err = |reason: String| PolicyError::HostPattern {
        pattern: s.to_owned(),
        reason,
    };
    let t = s.trim();
    if t.starts_with("*.") && !t[2..].contains('.') {
        return Err(err(
            "a wildcard over a top-level domain would send the secret to any site".into(),
        ));
    }
    match parse_domain_pattern(t).map_err(err)? {
        Rule::Cidr(_) => unreachable!("domain patterns are never CIDRs"),
        r => Ok(r),
    }
}

impl Rule {
    pub fn matches_name(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.');
        match self {
            Rule::Cidr(_) => false,
            Rule::Exact(e) => name.eq_ignore_ascii_case(e),
            Rule::Wildcard(base) => {
                name.len() > base.len() + 1
                    && name.as_bytes()[name.len() - base.len() - 1] == b'.'
                    && name[name.len() - base.len()..].eq_ignore_ascii_case(base)
            }
        }
    }
}

/// Whether `name` matches one of a secret binding's host patterns (invalid patterns match
/// nothing).
pub fn matches_host(patterns: &[String], name: &str) -> bool {
    patterns
        .iter()
        .filter_map(|p| parse_host_pattern(p).ok())
        .any(|r| r.matches_name(name))
}

const fn net(a: u8, b: u8, c: u8, d: u8, len: u8) -> (u32, u8) {
    (u32::from_be_bytes([a, b, c, d]), len)
}

/// Never reachable from a sandbox, whatever the rules say.
pub const ALWAYS_DENIED: [(u32, u8); 6] = [
    net(0, 0, 0, 0, 8),
    net(127, 0, 0, 0, 8),
    net(169, 254, 0, 0, 16),
    net(224, 0, 0, 0, 4),
    net(240, 0, 0, 0, 4),
    net(255, 255, 255, 255, 32),
];

/// Not reachable in `open` mode unless an allow rule names them: private and shared ranges
/// (a node's LAN, cloud VPC services).
pub const DEFAULT_DENIED: [(u32, u8); 5] = [
    net(10, 0, 0, 0, 8),
    net(172, 16, 0, 0, 12),
    net(192, 168, 0, 0, 16),
    net(100, 64, 0, 0, 10),
    net(192, 0, 0, 0, 24),
];

fn to_net((addr, len): (u32, u8)) -> Ipv4Net {
    Ipv4Net::new(Ipv4Addr::from(addr), len).expect("valid constant prefix")
}

pub fn always_denied_nets() -> Vec<Ipv4Net> {
    ALWAYS_DENIED.iter().copied().map(to_net).collect()
}

pub fn default_denied_nets() -> Vec<Ipv4Net> {
    DEFAULT_DENIED.iter().copied().map(to_net).collect()
}

pub fn always_denied(ip: Ipv4Addr) -> bool {
    ALWAYS_DENIED.iter().any(|&n| to_net(n).contains(&ip))
}

pub fn default_denied(ip: Ipv4Addr) -> bool {
    always_denied(ip) || DEFAULT_DENIED.iter().any(|&n| to_net(n).contains(&ip))
}

fn net_overlaps_always_denied(n: &Ipv4Net) -> bool {
    ALWAYS_DENIED.iter().any(|&d| {
        let d = to_net(d);
        d.contains(n) || n.contains(&d)
    })
}

/// A validated, compiled egress policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    egress: Egress,
    spec: NetworkSpec,
    cidrs: Vec<Ipv4Net>,
    names: Vec<Rule>,
    /// Ranges no rule can open: the node's slot subnet (other sandboxes).
    reserved: Vec<Ipv4Net>,
}

impl Policy {
    /// Validates `spec`. `reserved` are ranges no rule may open (the node's slot subnet).
    pub fn new(spec: &NetworkSpec, reserved: &[Ipv4Net]) -> Result<Policy, PolicyError> {
        if spec.allow.len() > MAX_RULES {
            return Err(PolicyError::TooMany(spec.allow.len()));
        }
        if spec.egress == Egress::None && !spec.allow.is_empty() {
            return Err(PolicyError::RulesWithNone(spec.allow.len()));
        }
        let mut cidrs = Vec::new();
        let mut names = Vec::new();
        for r in &spec.allow {
            match parse_rule(r)? {
                Rule::Cidr(n) => {
                    if reserved
                        .iter()
                        .any(|res| res.contains(&n) || n.contains(res))
                    {
                        return Err(PolicyError::Rule {
                            rule: r.clone(),
                            reason: "overlaps the node's sandbox network, which sandboxes can \
                                     never reach"
                                .into(),
                        });
                    }
                    cidrs.push(n);
                }
                other => names.push(other),
            }
        }
        Ok(Policy {
            egress: spec.egress,
            spec: spec.clone(),
            cidrs,
            names,
            reserved: reserved.to_vec(),
        })
    }

    /// The policy that allows nothing (fresh slots start with it).
    pub fn deny_all() -> Policy {
        Policy {
            egress: Egress::None,
            spec: NetworkSpec {
                egress: Egress::None,
                allow: vec![],
            },
            cidrs: vec![],
            names: vec![],
            reserved: vec![],
        }
    }

    pub fn egress(&self) -> Egress {
        self.egress
    }

    pub fn spec(&self) -> &NetworkSpec {
        &self.spec
    }

    /// The CIDR rules (for the kernel's `allow4` set).
    pub fn cidrs(&self) -> &[Ipv4Net] {
        &self.cidrs
    }

    /// Whether the domain rules cover anything (DNS answers then feed the kernel's `dns4`).
    pub fn has_domain_rules(&self) -> bool {
        !self.names.is_empty()
    }

    fn reserved(&self, ip: Ipv4Addr) -> bool {
        always_denied(ip) || self.reserved.iter().any(|n| n.contains(&ip))
    }

    fn in_cidrs(&self, ip: Ipv4Addr) -> bool {
        self.cidrs.iter().any(|n| n.contains(&ip))
    }

    /// Whether the sandbox may look up and reach `name` (DNS, SNI, Host).
    pub fn allows_name(&self, name: &str) -> bool {
        match self.egress {
            Egress::None => false,
            Egress::Allowlist => self.names.iter().any(|r| r.matches_name(name)),
            Egress::Open => true,
        }
    }

    /// Whether the sandbox may connect to `ip` by address (no name involved).
    pub fn allows_ip(&self, ip: Ipv4Addr) -> bool {
        if self.reserved(ip) {
            return false;
        }
        match self.egress {
            Egress::None => false,
            Egress::Allowlist => self.in_cidrs(ip),
            Egress::Open => !default_denied(ip) || self.in_cidrs(ip),
        }
    }

    /// Whether an address that a name the policy allows resolved to may be used: a public
    /// name must not lead into private or reserved ranges (DNS rebinding) unless a CIDR rule
    /// opens them.
    pub fn allows_resolved_ip(&self, ip: Ipv4Addr) -> bool {
        if self.reserved(ip) || self.egress == Egress::None {
            return false;
        }
        !default_denied(ip) || self.in_cidrs(ip)
    }

    /// Whether a connection to `ip`, allowed by `name` if any, is allowed: by name and
    /// resolved address, or by address alone.
    pub fn allows_connection(&self, name: Option<&str>, ip: Ipv4Addr) -> bool {
        let by_name = name.is_some_and(|n| self.allows_name(n) && self.allows_resolved_ip(ip));
        by_name || self.allows_ip(ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(egress: Egress, allow: &[&str]) -> NetworkSpec {
        NetworkSpec {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn rules_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_rule("203.0.113.0/24").unwrap(),
            Rule::Cidr("203.0.113.0/24".parse().unwrap())
        );
        assert_eq!(
            parse_rule("203.0.113.7").unwrap(),
            Rule::Cidr("203.0.113.7/32".parse().unwrap())
        );
        assert_eq!(
            parse_rule("API.Example.com.").unwrap(),
            Rule::Exact("api.example.com".into())
        );
        assert_eq!(
            parse_rule("*.example.com").unwrap(),
            Rule::Wildcard("example.com".into())
        );
        for bad in [
            "",
            "203.0.113.0/33",
            "203.0.113.1/24",
            "300.1.1.1",
            "0.0.0.0/0",
            "169.254.169.254",
            "127.0.0.1",
            "224.0.0.0/4",
            "*",
            "a.*.com",
            "*example.com",
            "exa mple.com",
            "localhost",
            "-bad.com",
            "::1",
            "10.0.0.0/8/1",
        ] {
            let e = parse_rule(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn host_patterns_refuse_catch_alls() {
        assert!(parse_host_pattern("api.example.com").is_ok());
        assert!(parse_host_pattern("*.example.com").is_ok());
        for bad in ["*", "*.com", "203.0.113.7", "", "a*.example.com"] {
            assert!(parse_host_pattern(bad).is_err(), "{bad}");
        }
        let hosts = vec!["api.example.com".to_string(), "*.corp.example".to_string()];
        assert!(matches_host(&hosts, "API.example.com"));
        assert!(matches_host(&hosts, "x.corp.example"));
        assert!(!matches_host(&hosts, "corp.example"));
        assert!(!matches_host(&hosts, "evilcorp.example"));
        assert!(!matches_host(&hosts, "api.example.com.evil.test"));
    }

    #[test]
    fn wildcard_matches_only_below() {
        let r = parse_rule("*.example.com").unwrap();
        assert!(r.matches_name("a.example.com"));
        assert!(r.matches_name("a.b.example.com."));
        assert!(!r.matches_name("example.com"));
        assert!(!r.matches_name("badexample.com"));
        assert!(!r.matches_name("example.com.evil"));
    }

    #[test]
    fn modes_decide_names_and_addresses() {
        let subnet: Ipv4Net = "10.213.0.0/16".parse().unwrap();
        let none = Policy::new(&spec(Egress::None, &[]), &[subnet]).unwrap();
        assert!(!none.allows_name("example.com"));
        assert!(!none.allows_ip(ip("203.0.113.10")));
        assert!(!none.allows_connection(Some("example.com"), ip("203.0.113.10")));

        let allow = Policy::new(
            &spec(
                Egress::Allowlist,
                &[
                    "203.0.113.11/32",
                    "api.example.test",
                    "*.svc.test",
                    "10.9.0.0/16",
                ],
            ),
            &[subnet],
        )
        .unwrap();
        assert!(allow.allows_name("api.example.test"));
        assert!(allow.allows_name("x.svc.test"));
        assert!(!allow.allows_name("other.example.test"));
        assert!(allow.allows_ip(ip("203.0.113.11")));
        assert!(!allow.allows_ip(ip("203.0.113.10")));
        assert!(allow.allows_ip(ip("10.9.1.1")), "explicit private CIDR");
        assert!(allow.allows_connection(Some("api.example.test"), ip("203.0.113.10")));
        assert!(!allow.allows_connection(Some("api.example.test"), ip("192.168.1.1")));
        assert!(!allow.allows_connection(Some("api.example.test"), ip("169.254.169.254")));
        assert!(!allow.allows_connection(Some("other.example.test"), ip("203.0.113.10")));

        let open = Policy::new(&spec(Egress::Open, &[]), &[subnet]).unwrap();
        assert!(open.allows_name("anything.example"));
        assert!(open.allows_ip(ip("203.0.113.10")));
        for denied in [
            "10.0.0.1",
            "192.168.1.1",
            "172.16.0.1",
            "100.64.0.1",
            "127.0.0.1",
        ] {
            assert!(!open.allows_ip(ip(denied)), "{denied}");
        }
        assert!(!open.allows_ip(ip("169.254.169.254")));
        assert!(!open.allows_ip(ip("10.213.0.6")), "other sandboxes");
        let open_lan = Policy::new(&spec(Egress::Open, &["192.168.5.0/24"]), &[subnet]).unwrap();
        assert!(open_lan.allows_ip(ip("192.168.5.9")));
        assert!(!open_lan.allows_ip(ip("192.168.6.9")));
    }

    #[test]
    fn invalid_policies_are_refused() {
        let subnet: Ipv4Net = "10.213.0.0/16".parse().unwrap();
        assert_eq!(
            Policy::new(&spec(Egress::None, &["1.2.3.4"]), &[subnet]).unwrap_err(),
            PolicyError::RulesWithNone(1)
        );
        let e = Policy::new(&spec(Egress::Allowlist, &["10.213.4.0/24"]), &[subnet]).unwrap_err();
        assert!(e.to_string().contains("10.213.4.0/24"));
        let e = Policy::new(&spec(Egress::Allowlist, &["10.0.0.0/8"]), &[subnet]).unwrap_err();
        assert!(e.to_string().contains("sandbox network"), "{e}");
        let many: Vec<String> = (0..=MAX_RULES)
            .map(|i| format!("h{i}.example.com"))
            .collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(matches!(
            Policy::new(&spec(Egress::Allowlist, &refs), &[subnet]),
            Err(PolicyError::TooMany(_))
        ));
    }
}
