//! What a microvm guest's daemon (root of its own kernel) does to take a fresh identity after
//! a restore or fork (issue 6): credit entropy to the kernel RNG and reseed it, and step the
//! realtime clock.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: u32 = 0x4008_5203;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: u32 = 0x0000_5207;
/// The most entropy bytes one call passes (the kernel takes any size; this bounds the copy).
pub const MAX_ENTROPY_BYTES: usize = 4096;

/// Mixes `bytes` into the kernel's input pool, credits them as entropy (8 bits a byte) and
/// forces the CRNG to reseed from it, so `getrandom` output after this call no longer follows
/// from the state a checkpoint captured. Needs CAP_SYS_ADMIN (the guest's init has it).
pub fn reseed_kernel_rng(bytes: &[u8]) -> io::Result<()> {
    if bytes.is_empty() || bytes.len() > MAX_ENTROPY_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("entropy must be 1 to {MAX_ENTROPY_BYTES} bytes"),
        ));
    }
    let dev = File::options().write(true).open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // SAFETY: `info` is a valid rand_pool_info (header + buf_size bytes) that lives across
    // the call; the kernel only reads it. The fd is open.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as libc::Ioctl, info.as_ptr()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: RNDRESEEDCRNG takes no argument; the fd is open.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as libc::Ioctl) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Steps `CLOCK_REALTIME` to `since_epoch`. Needs CAP_SYS_TIME.
pub fn set_realtime(since_epoch: Duration) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: since_epoch.as_secs() as libc::time_t,
        tv_nsec: since_epoch.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec that outlives the call; the kernel only reads it.
    let rc = unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_sizes_are_refused_before_any_syscall() {
        assert_eq!(
            reseed_kernel_rng(&[]).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            reseed_kernel_rng(&vec![0; MAX_ENTROPY_BYTES + 1])
                .unwrap_err()
                .kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn the_ioctl_numbers_match_the_kernel_encoding() {
        // _IOC(dir, type, nr, size) = dir << 30 | size << 16 | type << 8 | nr; write is 1.
        let ioc =
            |dir: u32, ty: u8, nr: u32, size: u32| dir << 30 | size << 16 | (ty as u32) << 8 | nr;
        assert_eq!(RNDADDENTROPY, ioc(1, b'R', 0x03, 8));
        assert_eq!(RNDRESEEDCRNG, ioc(0, b'R', 0x07, 0));
    }
}
