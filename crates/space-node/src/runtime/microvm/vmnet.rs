//! A microvm's network link (decision 0014, "Networking"): a tap device in the sandbox's
//! network slot, which QEMU (jailed inside that slot) gets as an inherited descriptor.
//!
//! In a slot the tap is the guest's gateway: `169.254.0.1/30` (the guest is `.2`), with
//! forwarding on so the slot's nftables rules can forward the guest's packets through the
//! slot's egress policy; its DNS is DNATed to the slot's gateway, and the node's root table
//! takes that and its HTTP(S) to the node's DNS and proxy (decision 0059). Nothing is
//! routed to the slot's loopback, so `route_localnet` stays off. Without a slot (a node with networking off, a
//! template's checkpoint builder) the tap sits alone, down, in a fresh namespace: the guest
//! has the same NIC and reaches nothing.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use space_proto::vm_link::{GATEWAY, PREFIX, TAP};
use space_sys::{netif, netns};

/// What QEMU runs with: the namespace it enters and the tap it inherits.
#[derive(Debug)]
pub struct VmLink {
    pub netns: OwnedFd,
    pub tap: OwnedFd,
}

/// How long a new tap waits for the name of a previous VM's tap to be free (a QEMU that was
/// just killed: its tap is unregistered shortly after its last descriptor closes).
const NAME_WAIT: Duration = Duration::from_secs(2);

/// Makes the link of a VM starting in `slot` (None: no network).
pub fn prepare(slot: Option<&File>) -> io::Result<VmLink> {
    match slot {
        Some(ns) => {
            let tap = netns::run_in(ns.as_fd(), slot_tap)??;
            Ok(VmLink {
                netns: ns.try_clone()?.into(),
                tap,
            })
        }
        None => {
            let ns = netns::create_anonymous()?;
            let tap = netns::run_in(ns.as_fd(), || netif::open_tap(TAP))??;
            Ok(VmLink { netns: ns, tap })
        }
    }
}

/// In the slot (the calling thread entered it): the tap, addressed and up, forwarding on.
fn slot_tap() -> io::Result<OwnedFd> {
    let t0 = Instant::now();
    let tap = loop {
        match netif::open_tap(TAP) {
            Ok(t) => break t,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && t0.elapsed() < NAME_WAIT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    };
    netif::set_ipv4(TAP, GATEWAY, PREFIX)?;
    netif::set_up(TAP)?;
    let path = "/proc/sys/net/ipv4/ip_forward";
    std::fs::write(path, "1").map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
    Ok(tap)
}

/// A locally administered unicast MAC for sandbox `id` (stable for its life).
pub fn mac_for(id: &str) -> [u8; 6] {
    use sha2::Digest;
    let h = sha2::Sha256::digest(id.as_bytes());
    [0x02, h[0], h[1], h[2], h[3], h[4]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_local_unicast_and_differ_per_sandbox() {
        let (a, b) = (mac_for("sbx-a"), mac_for("sbx-b"));
        assert_ne!(a, b);
        assert_eq!(a, mac_for("sbx-a"));
        for m in [a, b] {
            assert_eq!(m[0] & 0x03, 0x02, "locally administered, unicast: {m:02x?}");
        }
    }
}
