//! The guest kernel as `ensure_guest_kernel` (scripts/lib.sh) lays it out, the module load
//! order from its modules.dep, and the initramfs (a newc cpio written here): `/init` = the
//! static space-daemon, the modules, `/etc/space/modules`, `/dev/console`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Guest modules the VM needs; their dependencies are added from modules.dep. ext4 is built
/// into Debian's cloud kernel; should it ever be a module, it is loaded too.
pub const WANTED_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "ext4",
];

/// Where the initramfs lists the module paths, one per line, in load order.
pub const MODULES_LIST: &str = "etc/space/modules";

/// Errors finding the guest kernel or building the initramfs. Each names the file and what
/// to do about it.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    #[error(
        "guest kernel missing: run scripts/up: it unpacks linux-image-cloud-amd64 into {vm_dir} \
         (no {missing})"
    )]
    KernelMissing { vm_dir: PathBuf, missing: PathBuf },
    #[error("failed to read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("modules.dep line without ':': {0:?}")]
    BadModulesDep(String),
    #[error(
        "guest module {0} is neither built in nor in modules.dep; rerun scripts/up \
         (ensure_guest_kernel installs GUEST_MODULES)"
    )]
    ModuleMissing(String),
    #[error(
        "{path} is not a static executable ({why}); build it with \
         RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build -p space-daemon \
         --target x86_64-unknown-linux-gnu"
    )]
    NotStatic { path: PathBuf, why: &'static str },
    #[error("failed to write the initramfs: {0}")]
    Write(#[source] io::Error),
}

/// The guest kernel: `vmlinuz`, `version`, `modules/<version>/{kernel/..., modules.dep,
/// modules.builtin}`.
#[derive(Debug, Clone)]
pub struct GuestKernel {
    pub vmlinuz: PathBuf,
    pub version: String,
    /// `modules/<version>`; modules.dep paths are relative to it.
    pub modules: PathBuf,
}

impl GuestKernel {
    pub fn locate(vm_dir: &Path) -> Result<Self, InitramfsError> {
        let missing = |p: PathBuf| InitramfsError::KernelMissing {
            vm_dir: vm_dir.to_path_buf(),
            missing: p,
        };
        let vmlinuz = vm_dir.join("vmlinuz");
        let version_file = vm_dir.join("version");
        for p in [&vmlinuz, &version_file] {
            if !p.is_file() {
                return Err(missing(p.clone()));
            }
        }
        let version = read_string(&version_file)?.trim().to_owned();
        let modules = vm_dir.join("modules").join(&version);
        if !modules.join("modules.dep").is_file() {
            return Err(missing(modules.join("modules.dep")));
        }
        Ok(Self {
            vmlinuz,
            version,
            modules,
        })
    }

    /// Module files (relative to `modules`) to load, in load order, for `wanted`.
    pub fn load_order(&self, wanted: &[&str]) -> Result<Vec<String>, InitramfsError> {
        let dep = read_string(&self.modules.join("modules.dep"))?;
        // An absent modules.builtin only means nothing is known to be built in.
        let builtin = match std::fs::read_to_string(self.modules.join("modules.builtin")) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
            Err(source) => {
                return Err(InitramfsError::Read {
                    path: self.modules.join("modules.builtin"),
                    source,
                });
            }
        };
        load_order(&dep, &builtin, wanted)
    }
}

fn read_string(path: &Path) -> Result<String, InitramfsError> {
    std::fs::read_to_string(path).map_err(|source| InitramfsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// `foo/bar/virtio-blk.ko` -> `virtio_blk` (how the kernel names modules).
pub fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.trim().replace('-', "_")
}

/// Load order for `wanted`: every module after all it depends on, each once. Modules built
/// into the kernel (listed in modules.builtin) are skipped; anything else missing from
/// modules.dep is an error.
pub fn load_order(
    modules_dep: &str,
    builtin: &str,
    wanted: &[&str],
) -> Result<Vec<String>, InitramfsError> {
    let builtin: BTreeSet<String> = builtin.lines().map(module_name).collect();
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in modules_dep.lines().filter(|l| !l.trim().is_empty()) {
        let (path, rest) = line
            .split_once(':')
            .ok_or_else(|| InitramfsError::BadModulesDep(line.to_owned()))?;
        let needs = rest.split_whitespace().map(str::to_owned).collect();
        deps.insert(module_name(path), (path.trim().to_owned(), needs));
    }
    fn visit(
        name: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        builtin: &BTreeSet<String>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) -> Result<(), InitramfsError> {
        if !seen.insert(name.to_owned()) {
            return Ok(());
        }
        let Some((path, needs)) = deps.get(name) else {
            if builtin.contains(name) {
                return Ok(());
            }
            return Err(InitramfsError::ModuleMissing(name.to_owned()));
        };
        // depmod lists dependencies so that the last one loads first.
        for d in needs.iter().rev() {
            visit(&module_name(d), deps, builtin, seen, out)?;
        }
        out.push(path.clone());
        Ok(())
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for w in wanted {
        visit(&w.replace('-', "_"), &deps, &builtin, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// Refuses anything but a static ELF executable: a dynamic /init dies in the guest with a
/// bare "Requested init /init failed (error -2)" kernel panic.
pub fn check_static(path: &Path, bytes: &[u8]) -> Result<(), InitramfsError> {
    let not = |why| InitramfsError::NotStatic {
        path: path.to_path_buf(),
        why,
    };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" {
        return Err(not("not an ELF file"));
    }
    if bytes[4] != 2 || bytes[5] != 1 {
        return Err(not("not a 64-bit little-endian ELF"));
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
    };
    let phoff = u64_at(0x20).ok_or_else(|| not("truncated ELF header"))?;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let Some(ty) = bytes.get(at..at + phentsize.max(4)) else {
            return Err(not("truncated program headers"));
        };
        // PT_INTERP: the binary needs a dynamic loader.
        if u32::from_le_bytes([ty[0], ty[1], ty[2], ty[3]]) == 3 {
            return Err(not("it has an ELF interpreter (dynamically linked)"));
        }
    }
    Ok(())
}

/// One file to put into the initramfs besides `/init` and the modules (tests add a shell).
#[derive(Debug, Clone)]
pub struct ExtraFile {
    pub path: String,
    pub mode: u32,
    pub data: Vec<u8>,
}

/// The initramfs: `/init`, `/dev/console`, the modules in `order` under
/// `/lib/modules/<version>`, [`MODULES_LIST`] naming them (absolute paths) in that order.
pub fn build(
    kernel: &GuestKernel,
    order: &[String],
    init: &[u8],
    extra: &[ExtraFile],
) -> Result<Vec<u8>, InitramfsError> {
    let mut cpio = Cpio::new(Vec::new());
    let mut dirs = BTreeSet::new();
    let mut list = String::new();
    fn add(
        cpio: &mut Cpio<Vec<u8>>,
        dirs: &mut BTreeSet<PathBuf>,
        rel: &str,
        mode: u32,
        data: &[u8],
    ) -> io::Result<()> {
        // Parent directories first, each once.
        let mut parents: Vec<&Path> = Path::new(rel).ancestors().skip(1).collect();
        parents.reverse();
        for p in parents.into_iter().filter(|p| !p.as_os_str().is_empty()) {
            if dirs.insert(p.to_path_buf()) {
                cpio.dir(&p.to_string_lossy())?;
            }
        }
        cpio.file(rel, mode, data)
    }
    cpio.dir("dev").map_err(InitramfsError::Write)?;
    cpio.char_dev("dev/console", 0o600, 5, 1)
        .map_err(InitramfsError::Write)?;
    dirs.insert(PathBuf::from("dev"));
    for m in order {
        let rel = format!("lib/modules/{}/{m}", kernel.version);
        let src = kernel.modules.join(m);
        let data =
            std::fs::read(&src).map_err(|source| InitramfsError::Read { path: src, source })?;
        add(&mut cpio, &mut dirs, &rel, 0o644, &data).map_err(InitramfsError::Write)?;
        list += &format!("/{rel}\n");
    }
    add(&mut cpio, &mut dirs, MODULES_LIST, 0o644, list.as_bytes())
        .map_err(InitramfsError::Write)?;
    for f in extra {
        add(
            &mut cpio,
            &mut dirs,
            f.path.trim_start_matches('/'),
            f.mode,
            &f.data,
        )
        .map_err(InitramfsError::Write)?;
    }
    cpio.file("init", 0o755, init)
        .map_err(InitramfsError::Write)?;
    cpio.finish().map_err(InitramfsError::Write)
}

pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFCHR: u32 = 0o020000;

/// A newc ("070701") cpio archive writer, the format the kernel unpacks as initramfs.
pub struct Cpio<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

impl<W: Write> Cpio<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            next_ino: 1,
        }
    }

    pub fn dir(&mut self, name: &str) -> io::Result<()> {
        self.entry(name, S_IFDIR | 0o755, 2, (0, 0), &[])
    }

    pub fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.entry(name, S_IFREG | mode, 1, (0, 0), data)
    }

    pub fn char_dev(&mut self, name: &str, mode: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(name, S_IFCHR | mode, 1, (major, minor), &[])
    }

    /// Writes the trailer and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[])?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> io::Result<()> {
        let size = u32::try_from(data.len()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{name}: {} bytes exceed the newc limit of 4 GiB",
                    data.len()
                ),
            )
        })?;
        let ino = self.next_ino;
        self.next_ino += 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{size:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0, // uid
            0, // gid
            0, // mtime
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            name.len() + 1,
            0, // check
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.written % 4)) % 4;
        self.put(&[0u8; 3][..n as usize])
    }
}
