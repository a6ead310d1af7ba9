//! Egress rules: parsing (clear errors naming the bad rule) and matching, shared by the kernel
//! rules (CIDR sets), the DNS server (names) and the egress proxy (names and addresses).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::net::{Egress, NetworkSpec};

/// At most this many allow rules per sandbox.
pub const MAX_RULES: usize = 256;
/// At most this many ports or port ranges in one rule.
pub const MAX_PORT_RANGES: usize = 16;

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

/// A set of TCP/UDP ports: sorted, disjoint, non-adjacent inclusive ranges.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Ports(Vec<(u16, u16)>);

impl Ports {
    /// What a rule without ports admits: HTTP and HTTPS (issue 15; decision 0047).
    pub fn web() -> Ports {
        Ports(vec![(80, 80), (443, 443)])
    }

    /// Every port (`:*`).
    pub fn all() -> Ports {
        Ports(vec![(1, 65535)])
    }

    /// The union of `ranges` (each `lo <= hi`; others are ignored).
    pub fn new(ranges: impl IntoIterator<Item = (u16, u16)>) -> Ports {
        let mut v: Vec<(u16, u16)> = ranges.into_iter().filter(|(lo, hi)| lo <= hi).collect();
        v.sort_unstable();
        let mut out: Vec<(u16, u16)> = Vec::with_capacity(v.len());
        for (lo, hi) in v {
            match out.last_mut() {
                Some(last) if u32::from(lo) <= u32::from(last.1) + 1 => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        Ports(out)
    }

    pub fn ranges(&self) -> &[(u16, u16)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, port: u16) -> bool {
        self.0.iter().any(|&(lo, hi)| lo <= port && port <= hi)
    }

    /// Whether every port of `other` is in `self`.
    pub fn covers(&self, other: &Ports) -> bool {
        other
            .0
            .iter()
            .all(|&(lo, hi)| self.0.iter().any(|&(a, b)| a <= lo && hi <= b))
    }

    pub fn union(&self, other: &Ports) -> Ports {
        Ports::new(self.0.iter().chain(&other.0).copied())
    }

    /// Parses what follows a rule's `:`: `*`, or ports and ranges separated by commas
    /// (`443`, `8000-8100`, `22,80,8000-8100`).
    pub fn parse(s: &str) -> Result<Ports, String> {
        if s == "*" {
            return Ok(Ports::all());
        }
        if s.is_empty() {
            return Err("no port after ':' (name one, a range like 8000-8100, or *)".into());
        }
        let items: Vec<&str> = s.split(',').collect();
        if items.len() > MAX_PORT_RANGES {
            return Err(format!(
                "{} ports or ranges; at most {MAX_PORT_RANGES} per rule",
                items.len()
            ));
        }
        let port = |p: &str| match p.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(format!("{p:?} is not a port (1 to 65535)")),
            Ok(n) => Ok(n),
        };
        let mut ranges = Vec::with_capacity(items.len());
        for item in items {
            let (lo, hi) = match item.split_once('-') {
                Some((lo, hi)) => (port(lo)?, port(hi)?),
                None => {
                    let p = port(item)?;
                    (p, p)
                }
            };
            if lo > hi {
                return Err(format!("port range {item:?} ends before it starts"));
            }
            ranges.push((lo, hi));
        }
        Ok(Ports::new(ranges))
    }
}

impl std::fmt::Display for Ports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, &(lo, hi)) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { "," };
            if lo == hi {
                write!(f, "{sep}{lo}")?;
            } else {
                write!(f, "{sep}{lo}-{hi}")?;
            }
        }
        Ok(())
    }
}

/// One validated allow rule: what it admits, on which ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowRule {
    pub target: Rule,
    /// [`Ports::web`] when the rule names none.
    pub ports: Ports,
}

/// What an allow rule or a secret's host pattern names.
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
/// or a wildcard domain, then optionally `:` and its ports (`api.example.com:8443`,
/// `10.0.0.0/8:5432,6379`, `db.example.com:5000-5100`, `203.0.113.7:*`). Without ports a rule
/// admits 80 and 443.
pub fn parse_rule(s: &str) -> Result<AllowRule, PolicyError> {
    let err = |reason: String| PolicyError::Rule {
        rule: s.to_owned(),
        reason,
    };
    let t = s.trim();
    // One ':' separates the ports; more than one is an IPv6 address, refused below.
    let (t, ports) = match t.rsplit_once(':') {
        Some((target, ports)) if !target.contains(':') => {
            (target, Ports::parse(ports.trim()).map_err(err)?)
        }
        _ => (t, Ports::web()),
    };
    Ok(AllowRule {
        target: parse_target(s, t.trim())?,
        ports,
    })
}

/// The part of allow rule `s` before its ports, `t`.
fn parse_target(s: &str, t: &str) -> Result<Rule, PolicyError> {
    let err = |reason: String| PolicyError::Rule {
        rule: s.to_owned(),
        reason,
    };
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

/// Cloud metadata services outside 169.254.0.0/16 (which [`ALWAYS_DENIED`] holds: AWS, GCP,
/// Azure's IMDS, OpenStack, DigitalOcean, ECS task metadata): Alibaba Cloud's, Azure's
/// WireServer, Oracle Cloud Classic's. Never reachable, whatever the rules say; unlike
/// [`ALWAYS_DENIED`], a rule may contain them (`100.64.0.0/10`) and simply never reaches
/// them. Their IPv6 counterparts (`fd00:ec2::254`, ...) are out of reach with all of IPv6:
/// slots have none.
pub const METADATA: [(u32, u8); 3] = [
    net(100, 100, 100, 200, 32),
    net(168, 63, 129, 16, 32),
    net(192, 0, 0, 192, 32),
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

/// Every address a sandbox never reaches: [`ALWAYS_DENIED`] and [`METADATA`].
pub fn never_reached_nets() -> Vec<Ipv4Net> {
    ALWAYS_DENIED
        .iter()
        .chain(&METADATA)
        .copied()
        .map(to_net)
        .collect()
}

pub fn default_denied_nets() -> Vec<Ipv4Net> {
    DEFAULT_DENIED.iter().copied().map(to_net).collect()
}

pub fn always_denied(ip: Ipv4Addr) -> bool {
    ALWAYS_DENIED
        .iter()
        .chain(&METADATA)
        .any(|&n| to_net(n).contains(&ip))
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
    cidrs: Vec<(Ipv4Net, Ports)>,
    names: Vec<(Rule, Ports)>,
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
            let AllowRule { target, ports } = parse_rule(r)?;
            match target {
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
                    cidrs.push((n, ports));
                }
                other => names.push((other, ports)),
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

    /// The CIDR rules with their ports (for the kernel's `allow4` set).
    pub fn cidrs(&self) -> &[(Ipv4Net, Ports)] {
        &self.cidrs
    }

    fn reserved(&self, ip: Ipv4Addr) -> bool {
        always_denied(ip) || self.reserved.iter().any(|n| n.contains(&ip))
    }

    fn in_cidrs(&self, ip: Ipv4Addr) -> bool {
        self.cidrs.iter().any(|(n, _)| n.contains(&ip))
    }

    /// Whether the sandbox may look up `name` (DNS), on whichever ports its rules name.
    pub fn allows_name(&self, name: &str) -> bool {
        match self.egress {
            Egress::None => false,
            Egress::Allowlist => self.names.iter().any(|(r, _)| r.matches_name(name)),
            Egress::Open => true,
        }
    }

    /// The ports the sandbox may reach `name` on: those of every rule naming it.
    pub fn name_ports(&self, name: &str) -> Ports {
        match self.egress {
            Egress::None => Ports::default(),
            Egress::Allowlist => self
                .names
                .iter()
                .filter(|(r, _)| r.matches_name(name))
                .fold(Ports::default(), |acc, (_, p)| acc.union(p)),
            Egress::Open => Ports::all(),
        }
    }

    /// Whether the sandbox may reach `name` on `port` (SNI, Host).
    pub fn allows_name_on(&self, name: &str, port: u16) -> bool {
        match self.egress {
            Egress::None => false,
            Egress::Allowlist => self
                .names
                .iter()
                .any(|(r, p)| p.contains(port) && r.matches_name(name)),
            Egress::Open => true,
        }
    }

    /// Whether the sandbox may connect to `ip` port `port` by address (no name involved).
    pub fn allows_ip(&self, ip: Ipv4Addr, port: u16) -> bool {
        if self.reserved(ip) {
            return false;
        }
        let by_rule = self
            .cidrs
            .iter()
            .any(|(n, p)| p.contains(port) && n.contains(&ip));
        match self.egress {
            Egress::None => false,
            Egress::Allowlist => by_rule,
            Egress::Open => !default_denied(ip) || by_rule,
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

    /// Whether a connection to `ip` port `port`, allowed by `name` if any, is allowed: by name
    /// and resolved address, or by address alone.
    pub fn allows_connection(&self, name: Option<&str>, ip: Ipv4Addr, port: u16) -> bool {
        let by_name =
            name.is_some_and(|n| self.allows_name_on(n, port) && self.allows_resolved_ip(ip));
        by_name || self.allows_ip(ip, port)
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
            parse_rule("203.0.113.0/24").unwrap().target,
            Rule::Cidr("203.0.113.0/24".parse().unwrap())
        );
        assert_eq!(
            parse_rule("203.0.113.7").unwrap().target,
            Rule::Cidr("203.0.113.7/32".parse().unwrap())
        );
        assert_eq!(
            parse_rule("API.Example.com.").unwrap().target,
            Rule::Exact("api.example.com".into())
        );
        assert_eq!(
            parse_rule("*.example.com").unwrap().target,
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
        let r = parse_rule("*.example.com").unwrap().target;
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
        assert!(!none.allows_ip(ip("203.0.113.10"), 443));
        assert!(!none.allows_connection(Some("example.com"), ip("203.0.113.10"), 443));

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
        assert!(allow.allows_ip(ip("203.0.113.11"), 443));
        assert!(!allow.allows_ip(ip("203.0.113.10"), 443));
        assert!(
            allow.allows_ip(ip("10.9.1.1"), 443),
            "explicit private CIDR"
        );
        assert!(allow.allows_connection(Some("api.example.test"), ip("203.0.113.10"), 443));
        assert!(!allow.allows_connection(Some("api.example.test"), ip("192.168.1.1"), 443));
        assert!(!allow.allows_connection(Some("api.example.test"), ip("169.254.169.254"), 443));
        assert!(!allow.allows_connection(Some("other.example.test"), ip("203.0.113.10"), 443));

        let open = Policy::new(&spec(Egress::Open, &[]), &[subnet]).unwrap();
        assert!(open.allows_name("anything.example"));
        assert!(open.allows_ip(ip("203.0.113.10"), 443));
        for denied in [
            "10.0.0.1",
            "192.168.1.1",
            "172.16.0.1",
            "100.64.0.1",
            "127.0.0.1",
        ] {
            assert!(!open.allows_ip(ip(denied), 443), "{denied}");
        }
        assert!(!open.allows_ip(ip("169.254.169.254"), 443));
        // Metadata outside link-local: never, even through a rule that contains it.
        let cgnat = Policy::new(
            &spec(
                Egress::Allowlist,
                &["100.64.0.0/10:*", "168.63.0.0/16:*", "192.0.0.0/24:*"],
            ),
            &[subnet],
        )
        .unwrap();
        assert!(cgnat.allows_ip(ip("100.64.0.1"), 80));
        for meta in ["100.100.100.200", "168.63.129.16", "192.0.0.192"] {
            assert!(!cgnat.allows_ip(ip(meta), 80), "{meta}");
            assert!(!cgnat.allows_resolved_ip(ip(meta)), "{meta}");
            assert!(!open.allows_ip(ip(meta), 80), "{meta}");
        }
        assert!(!open.allows_ip(ip("10.213.0.6"), 443), "other sandboxes");
        let open_lan = Policy::new(&spec(Egress::Open, &["192.168.5.0/24"]), &[subnet]).unwrap();
        assert!(open_lan.allows_ip(ip("192.168.5.9"), 443));
        assert!(!open_lan.allows_ip(ip("192.168.6.9"), 443));
    }

    #[test]
    fn rules_name_their_ports_and_default_to_80_and_443() {
        let rule = |s: &str| parse_rule(s).unwrap();
        assert_eq!(rule("api.example.com").ports, Ports::web());
        assert_eq!(rule("203.0.113.0/24").ports.to_string(), "80,443");
        let r = rule("10.0.0.0/8:5432");
        assert_eq!(r.target, Rule::Cidr("10.0.0.0/8".parse().unwrap()));
        assert_eq!(r.ports.to_string(), "5432");
        assert_eq!(
            rule("*.example.com:8000-8100,22").ports.to_string(),
            "22,8000-8100"
        );
        assert_eq!(rule("203.0.113.7:*").ports, Ports::all());
        // Overlapping and adjacent ranges merge.
        assert_eq!(
            rule("a.example.com:80,81-90,85-100,443").ports.to_string(),
            "80-100,443"
        );
        for bad in [
            "a.example.com:",
            "a.example.com:0",
            "a.example.com:65536",
            "a.example.com:http",
            "a.example.com:90-80",
            "a.example.com:1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17",
            "10.0.0.0/8:22:33",
            "[::1]:80",
            ":443",
        ] {
            let e = parse_rule(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
        let p = Ports::new([(80, 80), (443, 443)]);
        assert!(p.contains(80) && p.contains(443) && !p.contains(81));
        assert!(Ports::all().covers(&p) && !p.covers(&Ports::all()) && p.covers(&p));
        assert_eq!(p.union(&Ports::new([(81, 442)])).to_string(), "80-443");
    }

    #[test]
    fn an_allowlist_admits_only_the_ports_its_rules_name() {
        let subnet: Ipv4Net = "10.213.0.0/16".parse().unwrap();
        let allow = Policy::new(
            &spec(
                Egress::Allowlist,
                &[
                    "api.example.test",
                    "db.example.test:5432",
                    "db.example.test:6379",
                    "203.0.113.11/32:7000-7010",
                    "198.51.100.0/24",
                ],
            ),
            &[subnet],
        )
        .unwrap();
        let web = ip("203.0.113.10");
        assert!(allow.allows_connection(Some("api.example.test"), web, 443));
        assert!(allow.allows_connection(Some("api.example.test"), web, 80));
        assert!(!allow.allows_connection(Some("api.example.test"), web, 22));
        assert!(!allow.allows_connection(Some("db.example.test"), web, 443));
        assert!(allow.allows_connection(Some("db.example.test"), web, 6379));
        assert_eq!(allow.name_ports("db.example.test").to_string(), "5432,6379");
        assert!(allow.name_ports("nope.example.test").is_empty());
        assert!(allow.allows_ip(ip("203.0.113.11"), 7005));
        assert!(!allow.allows_ip(ip("203.0.113.11"), 443));
        assert!(allow.allows_ip(ip("198.51.100.20"), 443));
        assert!(!allow.allows_ip(ip("198.51.100.20"), 7000));
        // Open egress keeps every port of the internet; a rule re-opening a private range
        // opens it on its ports only.
        let open = Policy::new(&spec(Egress::Open, &["192.168.5.0/24:22"]), &[subnet]).unwrap();
        assert!(open.allows_ip(ip("203.0.113.10"), 7000));
        assert!(open.allows_ip(ip("192.168.5.9"), 22));
        assert!(!open.allows_ip(ip("192.168.5.9"), 80));
        assert_eq!(open.name_ports("x.example"), Ports::all());
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
