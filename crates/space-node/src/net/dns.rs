//! DNS for sandboxes (decision 0012): one small server in the node's own namespace (UDP and
//! TCP; the root table redirects every slot's port-53 packets there, decision 0059) that
//! answers each query by the policy of the sandbox whose slot sent it,
//! and the node's forwarder to its upstream servers, which also resolves for the egress proxy
//! ([`Resolve`]).
//!
//! Per query: a name the policy does not allow gets REFUSED; AAAA gets an empty NOERROR (slots
//! are IPv4 only); anything else goes to the upstreams under a fresh id and comes back with
//! the sandbox's. A records the policy refuses (private, metadata, the node's subnet: DNS
//! rebinding) are removed from the answer; for allowlist policies the remaining addresses are
//! put into the slot's `dns4` set before the answer leaves, so the connection that follows is
//! let through.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::debug;

use super::nft::SlotFirewall;
use super::{Egress, Resolve, SandboxNet, SlotLookup, slot_of};
use space_node_api::policy::Policy;

/// Wait for one upstream server at most this long.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// A whole forwarded query (all upstreams) takes at most this long.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest UDP message read or sent.
const MAX_UDP: usize = 4096;
/// Queries of one slot in flight at once (UDP; more are dropped, clients retry).
const MAX_INFLIGHT: usize = 64;
/// TCP connections of one slot at once.
const MAX_TCP_CONNS: usize = 16;
/// A TCP connection idle this long is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// The node's upstream DNS servers (reached from the node's own namespace).
#[derive(Debug, Clone)]
pub struct Upstream {
    servers: Vec<SocketAddr>,
    timeout: Duration,
}

/// The nameservers of a resolv.conf text (port 53).
pub fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "nameserver").then_some(())?;
            let ip: IpAddr = w.next()?.parse().ok()?;
            Some(SocketAddr::new(ip, 53))
        })
        .collect()
}

fn new_id() -> u16 {
    rand::random()
}

fn with_id(msg: &[u8], id: u16) -> Vec<u8> {
    let mut v = msg.to_vec();
    v[..2].copy_from_slice(&id.to_be_bytes());
    v
}

impl Upstream {
    pub fn new(servers: Vec<SocketAddr>) -> Upstream {
        Upstream {
            servers,
            timeout: UPSTREAM_TIMEOUT,
        }
    }

    /// `configured`, or the nameservers of /etc/resolv.conf when empty.
    pub fn from_config(configured: &[SocketAddr]) -> Upstream {
        if !configured.is_empty() {
            return Upstream::new(configured.to_vec());
        }
        let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
        Upstream::new(parse_resolv_conf(&text))
    }

    pub fn servers(&self) -> &[SocketAddr] {
        &self.servers
    }

    /// Sends `query` (a whole DNS message) to the upstreams in turn until one answers; the
    /// answer carries the query's id. `tcp`: over TCP (no size limit) instead of UDP.
    pub async fn exchange(&self, query: &[u8], tcp: bool) -> io::Result<Vec<u8>> {
        if query.len() < 12 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "short DNS message",
            ));
        }
        let mut last = io::Error::new(io::ErrorKind::NotFound, "no upstream DNS server configured");
        for &server in &self.servers {
            let id = new_id();
            let q = with_id(query, id);
            let r = if tcp {
                tokio::time::timeout(self.timeout, exchange_tcp(server, &q)).await
            } else {
                tokio::time::timeout(self.timeout, exchange_udp(server, &q, id)).await
            };
            match r {
                Ok(Ok(resp)) if resp.len() >= 12 && resp[..2] == id.to_be_bytes() => {
                    return Ok(with_id(&resp, u16::from_be_bytes([query[0], query[1]])));
                }
                Ok(Ok(_)) => last = io::Error::other(format!("{server}: mismatched answer")),
                Ok(Err(e)) => last = io::Error::new(e.kind(), format!("{server}: {e}")),
                Err(_) => {
                    last = io::Error::new(io::ErrorKind::TimedOut, format!("{server}: timed out"))
                }
            }
        }
        Err(last)
    }
}

async fn exchange_udp(server: SocketAddr, q: &[u8], id: u16) -> io::Result<Vec<u8>> {
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(bind).await?;
    sock.connect(server).await?;
    sock.send(q).await?;
    let mut buf = vec![0u8; 65535];
    loop {
        let n = sock.recv(&mut buf).await?;
        // Anything else (a late answer to someone else, garbage) is ignored.
        if n >= 12 && buf[..2] == id.to_be_bytes() && buf[2] & 0x80 != 0 {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

async fn read_framed(s: &mut TcpStream) -> io::Result<Vec<u8>> {
    let len = s.read_u16().await? as usize;
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).await?;
    Ok(buf)
}

async fn write_framed(s: &mut TcpStream, msg: &[u8]) -> io::Result<()> {
    let len = u16::try_from(msg.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "DNS message over 64 KiB"))?;
    let mut out = Vec::with_capacity(msg.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
    s.write_all(&out).await
}

async fn exchange_tcp(server: SocketAddr, q: &[u8]) -> io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(server).await?;
    write_framed(&mut s, q).await?;
    read_framed(&mut s).await
}

fn rcode_of(resp: &Message) -> ResponseCode {
    resp.metadata.response_code
}

#[async_trait]
impl Resolve for Upstream {
    async fn lookup_v4(&self, name: &str) -> io::Result<Vec<Ipv4Addr>> {
        let name = Name::from_ascii(name)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?}: {e}")))?;
        let mut q = Message::query();
        q.metadata.recursion_desired = true;
        q.add_query(Query::query(name, RecordType::A));
        let bytes = q.to_vec().map_err(io::Error::other)?;
        let fut = async {
            let mut r = self.exchange(&bytes, false).await?;
            if r.len() >= 3 && r[2] & 0x02 != 0 {
                // Truncated: ask again over TCP.
                r = self.exchange(&bytes, true).await?;
            }
            Ok::<_, io::Error>(r)
        };
        let raw = tokio::time::timeout(QUERY_TIMEOUT, fut)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "DNS lookup timed out"))??;
        let resp = Message::from_vec(&raw).map_err(io::Error::other)?;
        match rcode_of(&resp) {
            ResponseCode::NoError | ResponseCode::NXDomain => {}
            other => return Err(io::Error::other(format!("DNS answer {other}"))),
        }
        Ok(resp
            .answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect())
    }
}

/// One slot's DNS server.
#[derive(Debug)]
pub struct SlotDns {
    net: Arc<SandboxNet>,
    firewall: Arc<SlotFirewall>,
    upstream: Arc<Upstream>,
    inflight: Arc<Semaphore>,
    tcp_conns: Arc<Semaphore>,
}

fn reply(req: &Message, rcode: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::error_msg(req.metadata.id, req.metadata.op_code, rcode);
    m.metadata.recursion_desired = req.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.queries = req.queries.clone();
    m.to_vec().ok()
}

/// FORMERR for a message that does not parse (header only, id echoed).
fn formerr(raw: &[u8]) -> Option<Vec<u8>> {
    if raw.len() < 12 || raw[2] & 0x80 != 0 {
        return None;
    }
    let m = Message::error_msg(
        u16::from_be_bytes([raw[0], raw[1]]),
        OpCode::Query,
        ResponseCode::FormErr,
    );
    m.to_vec().ok()
}

/// What to do with one query from a sandbox, before any upstream is asked.
#[derive(Debug)]
pub enum Verdict {
    /// Answer this at once (None: send nothing).
    Reply(Option<Vec<u8>>),
    /// The policy does not allow the name: REFUSED.
    Refused {
        reply: Option<Vec<u8>>,
        name: String,
    },
    /// Ask the upstreams about `name` (lowercase, no trailing dot).
    Forward { req: Message, name: String },
}

/// Judges one query from a sandbox by its policy (see the module's doc).
pub fn judge(raw: &[u8], policy: &Policy) -> Verdict {
    let Ok(req) = Message::from_vec(raw) else {
        return Verdict::Reply(formerr(raw));
    };
    if req.metadata.message_type != MessageType::Query {
        return Verdict::Reply(None);
    }
    if req.metadata.op_code != OpCode::Query {
        return Verdict::Reply(reply(&req, ResponseCode::NotImp));
    }
    if req.queries.len() != 1 {
        return Verdict::Reply(reply(&req, ResponseCode::FormErr));
    }
    let q = &req.queries[0];
    let name = dns_name(&q.name);
    if !policy.allows_name(&name) {
        return Verdict::Refused {
            reply: reply(&req, ResponseCode::Refused),
            name,
        };
    }
    if q.query_type == RecordType::AAAA {
        return Verdict::Reply(reply(&req, ResponseCode::NoError));
    }
    Verdict::Forward { req, name }
}

fn dns_name(n: &Name) -> String {
    n.to_ascii().trim_end_matches('.').to_ascii_lowercase()
}

/// An upstream's answer as the sandbox may see it.
#[derive(Debug)]
pub struct Screened {
    /// The answer, under the query's id.
    pub answer: Vec<u8>,
    /// Its IPv4 addresses with their TTLs: what an allowlist admits for the name.
    pub admit: Vec<(Ipv4Addr, u32)>,
}

/// Screens the upstream's answer `raw` to `req` (for `name`); None when it does not parse.
/// - An address record stays only when it belongs to the name asked, directly or through the
///   answer's CNAME chain from it: an answer cannot slip in addresses for other names (and an
///   allowlist admits only what belongs to the name it allows).
/// - An address the policy refuses after resolution (private, metadata, the node's subnet: DNS
///   rebinding) never reaches the sandbox, and IPv6 addresses never do (slots are IPv4 only).
/// - The additional section keeps no address records at all.
pub fn screen(req: &Message, name: &str, raw: &[u8], policy: &Policy) -> Option<Screened> {
    let mut resp = Message::from_vec(raw).ok()?;
    // The names the answer's CNAMEs lead to from the name asked (bounded by the answer's size:
    // each pass adds a name or ends).
    let mut names = vec![name.to_string()];
    for _ in 0..resp.answers.len() {
        let next = resp.answers.iter().find_map(|r| match &r.data {
            RData::CNAME(t) if names.contains(&dns_name(&r.name)) => {
                Some(dns_name(&t.0)).filter(|t| !names.contains(t))
            }
            _ => None,
        });
        match next {
            Some(n) => names.push(n),
            None => break,
        }
    }
    resp.answers.retain(|r| match &r.data {
        RData::A(a) => names.contains(&dns_name(&r.name)) && policy.allows_resolved_ip(a.0),
        RData::AAAA(_) => false,
        _ => true,
    });
    resp.additionals
        .retain(|r| !matches!(r.data, RData::A(_) | RData::AAAA(_)));
    let admit = resp
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some((a.0, r.ttl)),
            _ => None,
        })
        .collect();
    resp.metadata.id = req.metadata.id;
    Some(Screened {
        answer: resp.to_vec().ok()?,
        admit,
    })
}

impl SlotDns {
    pub fn new(
        net: Arc<SandboxNet>,
        firewall: Arc<SlotFirewall>,
        upstream: Arc<Upstream>,
    ) -> Arc<SlotDns> {
        Arc::new(SlotDns {
            net,
            firewall,
            upstream,
            inflight: Arc::new(Semaphore::new(MAX_INFLIGHT)),
            tcp_conns: Arc::new(Semaphore::new(MAX_TCP_CONNS)),
        })
    }

    /// The answer to one query from the sandbox (None: send nothing).
    pub async fn answer(&self, raw: &[u8], tcp: bool) -> Option<Vec<u8>> {
        let policy = self.net.policy();
        let (req, name) = match judge(raw, &policy) {
            Verdict::Reply(r) => return r,
            Verdict::Refused { reply, name } => {
                debug!(sandbox = %self.net.id(), name, "DNS query refused by policy");
                return reply;
            }
            Verdict::Forward { req, name } => (req, name),
        };
        let forward = async {
            let r = self.upstream.exchange(raw, false).await?;
            if tcp && r.len() >= 3 && r[2] & 0x02 != 0 {
                // Truncated over UDP and the client can take more: ask over TCP.
                return self.upstream.exchange(raw, true).await;
            }
            Ok(r)
        };
        let upstream = tokio::time::timeout(QUERY_TIMEOUT, forward).await;
        let raw_resp = match upstream {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                debug!(sandbox = %self.net.id(), name, error = %e, "upstream DNS failed");
                return reply(&req, ResponseCode::ServFail);
            }
            Err(_) => return reply(&req, ResponseCode::ServFail),
        };
        let Some(Screened { answer, admit }) = screen(&req, &name, &raw_resp, &policy) else {
            return reply(&req, ResponseCode::ServFail);
        };
        let admitted = if policy.egress() == Egress::Allowlist && !admit.is_empty() {
            self.firewall.allow_resolved(&policy, &name, &admit).await
        } else {
            Ok(())
        };
        if let Err(e) = admitted {
            debug!(sandbox = %self.net.id(), name, error = %e, "could not admit resolved addresses");
            return reply(&req, ResponseCode::ServFail);
        }
        Some(answer)
    }
}

/// Serves every slot's DNS from the node's own namespace (decision 0059) until the handles
/// are aborted. The root table redirects a slot's port 53 here; each query is answered by
/// the [`SlotDns`] of the slot it came from, and one from no slot gets nothing.
pub fn serve_node(
    udp: std::net::UdpSocket,
    tcp: std::net::TcpListener,
    lookup: SlotLookup<Arc<SlotDns>>,
) -> io::Result<Vec<JoinHandle<()>>> {
    udp.set_nonblocking(true)?;
    tcp.set_nonblocking(true)?;
    let udp = Arc::new(UdpSocket::from_std(udp)?);
    let tcp = TcpListener::from_std(tcp)?;
    let l = lookup.clone();
    let u = tokio::spawn(async move { serve_udp(udp, l).await });
    let t = tokio::spawn(async move { serve_tcp(tcp, lookup).await });
    Ok(vec![u, t])
}

async fn serve_udp(sock: Arc<UdpSocket>, lookup: SlotLookup<Arc<SlotDns>>) {
    let mut buf = vec![0u8; MAX_UDP];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(_) => {
                // ECONNREFUSED from an earlier send and the like: keep serving.
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        };
        let Some(slot) = slot_of(&lookup, peer) else {
            continue;
        };
        // A flood gets dropped, not queued: clients retry.
        let Ok(permit) = slot.inflight.clone().try_acquire_owned() else {
            continue;
        };
        let query = buf[..n].to_vec();
        let sock = sock.clone();
        tokio::spawn(async move {
            if let Some(mut a) = slot.answer(&query, false).await {
                if a.len() > MAX_UDP.max(512) {
                    // Ask the client to come back over TCP.
                    a.truncate(12);
                    a[2] |= 0x02;
                    a[4..12].fill(0);
                }
                let _ = sock.send_to(&a, peer).await;
            }
            drop(permit);
        });
    }
}

async fn serve_tcp(listener: TcpListener, lookup: SlotLookup<Arc<SlotDns>>) {
    loop {
        let Ok((mut conn, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        let Some(slot) = slot_of(&lookup, peer) else {
            continue;
        };
        let Ok(permit) = slot.tcp_conns.clone().try_acquire_owned() else {
            continue;
        };
        tokio::spawn(async move {
            while let Ok(Ok(q)) = tokio::time::timeout(TCP_IDLE, read_framed(&mut conn)).await {
                let Some(a) = slot.answer(&q, true).await else {
                    break;
                };
                if write_framed(&mut conn, &a).await.is_err() {
                    break;
                }
            }
            drop(permit);
        });
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::net::NetworkSpec;
    use crate::net::nft::RecordingNft;
    use crate::net::policy::Policy;
    use hickory_proto::rr::Record;
    use hickory_proto::rr::rdata::A;

    /// A fake upstream on loopback: answers A queries for `*.example.com` with the records
    /// given (name suffix -> addresses), NXDOMAIN otherwise. Counts the queries.
    pub(crate) async fn fake_upstream(
        records: Vec<(&'static str, Vec<Ipv4Addr>)>,
    ) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = count.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let (n, peer) = sock.recv_from(&mut buf).await.unwrap();
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let req = Message::from_vec(&buf[..n]).unwrap();
                let q = req.queries[0].clone();
                let qname = q.name.to_ascii().trim_end_matches('.').to_ascii_lowercase();
                let mut resp = Message::response(req.metadata.id, OpCode::Query);
                resp.metadata.recursion_available = true;
                resp.add_query(q.clone());
                match records.iter().find(|(n, _)| *n == qname) {
                    Some((_, ips)) => {
                        for ip in ips {
                            resp.add_answer(Record::from_rdata(
                                q.name.clone(),
                                30,
                                RData::A(A(*ip)),
                            ));
                        }
                    }
                    None => resp.metadata.response_code = ResponseCode::NXDomain,
                }
                sock.send_to(&resp.to_vec().unwrap(), peer).await.unwrap();
            }
        });
        (addr, count)
    }

    fn query(name: &str, t: RecordType, id: u16) -> Vec<u8> {
        let mut m = Message::new(id, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), t));
        m.to_vec().unwrap()
    }

    fn server(
        spec: NetworkSpec,
        upstream: SocketAddr,
    ) -> (Arc<SlotDns>, Arc<RecordingNft>, Arc<SandboxNet>) {
        let addr = Ipv4Addr::new(10, 213, 0, 2);
        let subnet = "10.213.0.0/16".parse().unwrap();
        let policy = Policy::new(&spec, &[subnet]).unwrap();
        let rec = Arc::new(RecordingNft::default());
        let fw = Arc::new(SlotFirewall::new(None, rec.clone(), addr, Some(&policy)));
        let net = SandboxNet::new("sb", addr, policy, vec![]);
        let dns = SlotDns::new(net.clone(), fw, Arc::new(Upstream::new(vec![upstream])));
        (dns, rec, net)
    }

    fn spec(egress: Egress, allow: &[&str]) -> NetworkSpec {
        NetworkSpec {
            egress,
            allow: allow.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn a_records(m: &Message) -> Vec<Ipv4Addr> {
        m.answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_answer_keeps_only_addresses_of_the_name_asked_and_its_cnames() {
        let name = |n: &str| Name::from_ascii(n).unwrap();
        let a = |n: &str, ip: [u8; 4]| Record::from_rdata(name(n), 30, RData::A(A(ip.into())));
        let policy = Policy::new(&spec(Egress::Allowlist, &["api.example.com"]), &[]).unwrap();
        let raw = query("api.example.com.", RecordType::A, 7);
        let Verdict::Forward { req, name: asked } = judge(&raw, &policy) else {
            panic!("an allowed name is forwarded");
        };
        assert_eq!(asked, "api.example.com");
        let mut resp = Message::response(99, OpCode::Query);
        resp.add_query(req.queries[0].clone());
        resp.add_answer(Record::from_rdata(
            name("API.example.com."),
            30,
            RData::CNAME(hickory_proto::rr::rdata::CNAME(name("edge.cdn.test."))),
        ));
        resp.add_answer(a("edge.cdn.test.", [93, 184, 216, 34]));
        // Not asked, not in the chain: an upstream (or an attacker on its path) slipping in
        // an address for another name does not get it admitted under the allowed one.
        resp.add_answer(a("other.test.", [93, 184, 216, 35]));
        resp.add_additional(a("glue.test.", [93, 184, 216, 36]));
        let s = screen(&req, &asked, &resp.to_vec().unwrap(), &policy).unwrap();
        let m = Message::from_vec(&s.answer).unwrap();
        assert_eq!(m.metadata.id, 7);
        assert_eq!(a_records(&m), vec![Ipv4Addr::new(93, 184, 216, 34)]);
        assert_eq!(s.admit, vec![(Ipv4Addr::new(93, 184, 216, 34), 30)]);
        assert!(m.additionals.is_empty());
        assert_eq!(m.answers.len(), 2, "the CNAME stays");
        assert!(matches!(
            judge(&query("other.test.", RecordType::A, 8), &policy),
            Verdict::Refused { .. }
        ));
    }

    #[test]
    fn resolv_conf_nameservers() {
        let s = parse_resolv_conf(
            "# c\nsearch x\nnameserver 192.0.2.53\nnameserver  ::1\nnameserver fe80::1%eth0\noptions x",
        );
        assert_eq!(
            s,
            vec![
                "192.0.2.53:53".parse::<SocketAddr>().unwrap(),
                "[::1]:53".parse().unwrap()
            ]
        );
    }

    #[tokio::test]
    async fn allowlist_refuses_other_names_and_admits_answers_before_replying() {
        let pub_ip = Ipv4Addr::new(93, 184, 216, 34);
        let (up, count) = fake_upstream(vec![
            ("api.example.com", vec![pub_ip, Ipv4Addr::new(10, 0, 0, 5)]),
            ("evil.example.com", vec![Ipv4Addr::new(169, 254, 169, 254)]),
        ])
        .await;
        let (dns, rec, _) = server(
            spec(Egress::Allowlist, &["api.example.com", "evil.example.com"]),
            up,
        );

        // Allowed: forwarded, id preserved, the private address removed, dns4 filled first.
        let a = dns
            .answer(&query("API.example.com.", RecordType::A, 4242), false)
            .await
            .unwrap();
        let m = Message::from_vec(&a).unwrap();
        assert_eq!(m.metadata.id, 4242);
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert_eq!(a_records(&m), vec![pub_ip]);
        let scripts = rec.taken();
        assert_eq!(scripts.len(), 1);
        assert!(
            scripts[0].contains("93.184.216.34 . 443 timeout 60s"),
            "{}",
            scripts[0]
        );
        assert!(!scripts[0].contains("10.0.0.5"));

        // Metadata address: removed, nothing admitted.
        let a = dns
            .answer(&query("evil.example.com", RecordType::A, 7), false)
            .await
            .unwrap();
        assert!(a_records(&Message::from_vec(&a).unwrap()).is_empty());
        assert!(rec.taken().is_empty());

        // Not allowed: REFUSED, upstream never asked.
        let before = count.load(std::sync::atomic::Ordering::SeqCst);
        let a = dns
            .answer(&query("other.org", RecordType::A, 9), false)
            .await
            .unwrap();
        let m = Message::from_vec(&a).unwrap();
        assert_eq!(m.metadata.response_code, ResponseCode::Refused);
        assert_eq!(m.metadata.id, 9);
        assert_eq!(m.queries.len(), 1);
        // AAAA of an allowed name: empty NOERROR, upstream never asked.
        let a = dns
            .answer(&query("api.example.com", RecordType::AAAA, 10), false)
            .await
            .unwrap();
        let m = Message::from_vec(&a).unwrap();
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert!(m.answers.is_empty());
        assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), before);

        // Garbage: FORMERR with the id, or nothing at all when too short.
        let mut junk = vec![0x12, 0x34, 0x01, 0x00];
        junk.extend_from_slice(&[0xff; 20]);
        let a = dns.answer(&junk, false).await.unwrap();
        let m = Message::from_vec(&a).unwrap();
        assert_eq!(
            (m.metadata.id, m.metadata.response_code),
            (0x1234, ResponseCode::FormErr)
        );
        assert!(dns.answer(&[1, 2, 3], false).await.is_none());
    }

    #[tokio::test]
    async fn none_refuses_everything_and_open_needs_no_nft() {
        let (up, count) =
            fake_upstream(vec![("a.example.com", vec![Ipv4Addr::new(8, 8, 4, 4)])]).await;
        let (dns, rec, net) = server(spec(Egress::Open, &[]), up);
        let a = dns
            .answer(&query("a.example.com", RecordType::A, 1), false)
            .await
            .unwrap();
        assert_eq!(
            a_records(&Message::from_vec(&a).unwrap()),
            vec![Ipv4Addr::new(8, 8, 4, 4)]
        );
        assert!(
            rec.taken().is_empty(),
            "open mode admits through open4, not dns4"
        );
        // NXDOMAIN passes through.
        let a = dns
            .answer(&query("b.example.com", RecordType::A, 2), false)
            .await
            .unwrap();
        assert_eq!(
            Message::from_vec(&a).unwrap().metadata.response_code,
            ResponseCode::NXDomain
        );

        net.set_policy(Policy::deny_all());
        let n = count.load(std::sync::atomic::Ordering::SeqCst);
        let a = dns
            .answer(&query("a.example.com", RecordType::A, 3), false)
            .await
            .unwrap();
        assert_eq!(
            Message::from_vec(&a).unwrap().metadata.response_code,
            ResponseCode::Refused
        );
        assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), n);
    }

    #[tokio::test]
    async fn a_dead_upstream_gives_servfail_in_bounded_time() {
        // A bound socket that never answers.
        let silent = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let (dns, _, _) = server(spec(Egress::Open, &[]), silent.local_addr().unwrap());
        let t0 = std::time::Instant::now();
        let a = dns
            .answer(&query("a.example.com", RecordType::A, 5), false)
            .await
            .unwrap();
        assert_eq!(
            Message::from_vec(&a).unwrap().metadata.response_code,
            ResponseCode::ServFail
        );
        assert!(t0.elapsed() < UPSTREAM_TIMEOUT + Duration::from_millis(500));
    }

    #[tokio::test]
    async fn resolve_uses_the_upstream() {
        let ip = Ipv4Addr::new(203, 0, 113, 9);
        let (up, _) = fake_upstream(vec![("host.example.com", vec![ip])]).await;
        let r = Upstream::new(vec![up]);
        assert_eq!(r.lookup_v4("host.example.com").await.unwrap(), vec![ip]);
        assert!(r.lookup_v4("nope.example.com").await.unwrap().is_empty());
        assert!(
            Upstream::new(vec![])
                .lookup_v4("host.example.com")
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn served_over_udp_and_tcp_to_the_slot_the_query_came_from() {
        let ip = Ipv4Addr::new(203, 0, 113, 10);
        let (up, _) = fake_upstream(vec![("s.example.com", vec![ip])]).await;
        let (dns, _, _) = server(spec(Egress::Open, &[]), up);
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let (addr, tcp_addr) = (udp.local_addr().unwrap(), tcp.local_addr().unwrap());
        // 127.0.0.1 is the one slot's address; anything else is no slot's.
        let lookup: SlotLookup<Arc<SlotDns>> =
            Arc::new(move |src| (src == Ipv4Addr::LOCALHOST).then(|| dns.clone()));
        let tasks = serve_node(udp, tcp, lookup).unwrap();

        let stranger = UdpSocket::bind("127.0.0.2:0").await.unwrap();
        stranger
            .send_to(&query("s.example.com", RecordType::A, 76), addr)
            .await
            .unwrap();
        let mut buf = vec![0u8; 1500];
        assert!(
            tokio::time::timeout(Duration::from_millis(300), stranger.recv(&mut buf))
                .await
                .is_err(),
            "a query from no slot is answered"
        );

        let c = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        c.send_to(&query("s.example.com", RecordType::A, 77), addr)
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(3), c.recv(&mut buf))
            .await
            .unwrap()
            .unwrap();
        let m = Message::from_vec(&buf[..n]).unwrap();
        assert_eq!((m.metadata.id, a_records(&m)), (77, vec![ip]));

        let mut t = TcpStream::connect(tcp_addr).await.unwrap();
        write_framed(&mut t, &query("s.example.com", RecordType::A, 78))
            .await
            .unwrap();
        let r = tokio::time::timeout(Duration::from_secs(5), read_framed(&mut t))
            .await
            .unwrap()
            .unwrap();
        let m = Message::from_vec(&r).unwrap();
        assert_eq!((m.metadata.id, a_records(&m)), (78, vec![ip]));
        for t in tasks {
            t.abort();
        }
    }
}
