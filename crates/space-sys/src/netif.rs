//! Network interfaces by ioctl, for the two places that configure a microvm's link without an
//! async runtime: the node (a tap device inside a sandbox's slot, on a thread that entered
//! it) and the guest's init (its `eth0`, before the daemon's runtime starts). Each call acts
//! on the network namespace of the calling thread.
//!
//! The classic `SIOC*` ioctls cover exactly what is needed (flags, one IPv4 address, a
//! default route, a MAC address); `rtnetlink` does the rest of the node's networking. Every
//! sandbox's loopback is brought up here too ([`crate::process::set_loopback_up`]).

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// An `ifreq` naming `name` (at most 15 bytes, no NUL), everything else zero.
fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    // SAFETY: ifreq is plain data (a name and a union of plain data); all-zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

/// A datagram socket to issue interface ioctls on.
fn ctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain integer arguments; the returned fd is owned below.
    let fd = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and sockaddr is plain
    // data, so every bit pattern of one is a valid other.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

/// Issues interface ioctl `request` with `req` on a fresh control socket.
fn ioctl(request: libc::c_ulong, req: &mut libc::ifreq) -> io::Result<()> {
    let sock = ctl_socket()?;
    // SAFETY: `req` is a valid, exclusively borrowed ifreq for the whole call, which is what
    // every SIOC*IF* request reads and writes.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), request as _, req as *mut libc::ifreq) }).map(drop)
}

/// Opens `/dev/net/tun` and makes (or attaches to) tap device `name` in the calling thread's
/// network namespace: `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, close-on-exec. A tap made here is
/// not persistent: it goes away when the last descriptor on it is closed.
pub fn open_tap(name: &str) -> io::Result<OwnedFd> {
    let mut req = ifreq(name)?;
    // SAFETY: static NUL-terminated path; the returned fd is owned below.
    let fd = cvt(unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) })
        .map_err(|e| io::Error::new(e.kind(), format!("open /dev/net/tun: {e}")))?;
    // SAFETY: `fd` was just returned by open() and is owned by nobody else.
    let tun = unsafe { OwnedFd::from_raw_fd(fd) };
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes the ifreq, valid and exclusively borrowed here.
    cvt(unsafe {
        libc::ioctl(
            tun.as_raw_fd(),
            libc::TUNSETIFF as _,
            &mut req as *mut libc::ifreq,
        )
    })
    .map_err(|e| io::Error::new(e.kind(), format!("create tap {name}: {e}")))?;
    Ok(tun)
}

/// Whether interface `name` exists in the calling thread's namespace.
pub fn exists(name: &str) -> bool {
    let Ok(mut req) = ifreq(name) else {
        return false;
    };
    ioctl(libc::SIOCGIFINDEX, &mut req).is_ok()
}

/// Brings interface `name` up. Returns whether it was down (false: it was up already).
pub fn set_up(name: &str) -> io::Result<bool> {
    let mut req = ifreq(name)?;
    ioctl(libc::SIOCGIFFLAGS, &mut req)
        .map_err(|e| io::Error::new(e.kind(), format!("read the flags of {name}: {e}")))?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(false);
    }
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    ioctl(libc::SIOCSIFFLAGS, &mut req)
        .map_err(|e| io::Error::new(e.kind(), format!("bring {name} up: {e}")))?;
    Ok(true)
}

/// Gives interface `name` the IPv4 address `addr/prefix` (replacing the one it had).
pub fn set_ipv4(name: &str, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
    if prefix > 32 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("prefix /{prefix} is longer than 32 bits"),
        ));
    }
    let mask = Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0));
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl(libc::SIOCSIFADDR, &mut req)
        .map_err(|e| io::Error::new(e.kind(), format!("address {name} as {addr}: {e}")))?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(mask);
    ioctl(libc::SIOCSIFNETMASK, &mut req)
        .map_err(|e| io::Error::new(e.kind(), format!("netmask {name} as /{prefix}: {e}")))
}

/// Sets the hardware address of interface `name`.
pub fn set_mac(name: &str, mac: [u8; 6]) -> io::Result<()> {
    let mut req = ifreq(name)?;
    // SAFETY: sockaddr is plain data; all-zero is valid.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::ARPHRD_ETHER;
    for (dst, src) in sa.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = sa;
    ioctl(libc::SIOCSIFHWADDR, &mut req)
        .map_err(|e| io::Error::new(e.kind(), format!("set the MAC address of {name}: {e}")))
}

/// The hardware address of interface `name`.
pub fn mac(name: &str) -> io::Result<[u8; 6]> {
    let mut req = ifreq(name)?;
    ioctl(libc::SIOCGIFHWADDR, &mut req)
        .map_err(|e| io::Error::new(e.kind(), format!("read the MAC address of {name}: {e}")))?;
    // SAFETY: SIOCGIFHWADDR filled the hwaddr member of the union.
    let sa = unsafe { req.ifr_ifru.ifru_hwaddr };
    let mut mac = [0u8; 6];
    for (dst, src) in mac.iter_mut().zip(sa.sa_data) {
        *dst = src as u8;
    }
    Ok(mac)
}

/// Adds the IPv4 default route via `gateway` (reachable on a connected subnet). An existing
/// equal route is fine.
pub fn add_default_route(gateway: Ipv4Addr) -> io::Result<()> {
    let sock = ctl_socket()?;
    // SAFETY: rtentry is plain data (addresses, integers, pointers left null); all-zero is
    // valid and means "no device, no metric".
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr_in(gateway);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: `rt` is a valid, exclusively borrowed rtentry for the whole call (SIOCADDRT
    // reads it); its `rt_dev` is null, so the kernel picks the device from the gateway.
    match cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCADDRT as _, &mut rt) }) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("add the default route via {gateway}: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_do_not_fit_an_ifreq_are_refused() {
        for bad in ["", "a-name-longer-than-15", "nul\0x"] {
            let e = ifreq(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
        assert!(ifreq("tap0").is_ok());
        let e = set_ipv4("tap0", Ipv4Addr::LOCALHOST, 33).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    /// Against the kernel, in a namespace of its own: a tap is made, addressed, brought up,
    /// routed through and given a MAC; it is gone with its last descriptor.
    #[test]
    fn a_tap_is_configured_inside_a_fresh_namespace() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root (CAP_NET_ADMIN)");
            return;
        }
        let ns = crate::netns::create_anonymous().unwrap();
        let seen = crate::netns::run_in(std::os::fd::AsFd::as_fd(&ns), || -> io::Result<String> {
            let tap = open_tap("tap0")?;
            set_mac("tap0", [0x02, 0x53, 0x50, 0, 0, 1])?;
            set_ipv4("tap0", Ipv4Addr::new(169, 254, 0, 1), 30)?;
            set_up("tap0")?;
            add_default_route(Ipv4Addr::new(169, 254, 0, 2))?;
            // A second time is fine.
            add_default_route(Ipv4Addr::new(169, 254, 0, 2))?;
            let addr = mac("tap0")?;
            let route = std::fs::read_to_string("/proc/thread-self/net/route")?;
            drop(tap);
            // Unregistering finishes shortly after the close.
            let gone = (0..100).any(|_| {
                let gone = !exists("tap0");
                if !gone {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                gone
            });
            Ok(format!("{addr:02x?}|{route}|{gone}"))
        })
        .unwrap()
        .unwrap();
        assert!(seen.starts_with("[02, 53, 50, 00, 00, 01]"), "{seen}");
        // The default route: destination 0, gateway 169.254.0.2 (little-endian hex).
        assert!(seen.contains("tap0\t00000000\t0200FEA9"), "{seen}");
        assert!(
            seen.ends_with("|true"),
            "the tap outlived its descriptor: {seen}"
        );
    }
}
