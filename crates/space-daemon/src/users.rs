//! Users and groups from the sandbox's own /etc/passwd and /etc/group, parsed directly:
//! a static glibc's getpwnam would need NSS modules that are not there.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("unknown user {0:?}")]
    Unknown(String),
}

/// A resolved user: who a process runs as, or who owns a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserInfo {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    /// Supplementary groups, the primary group first.
    pub groups: Vec<u32>,
}

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

fn passwd_entries(passwd: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    passwd.lines().filter_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        Some(PasswdEntry {
            name: f[0],
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            home: f[5],
        })
    })
}

/// Resolve `spec` (a user name or a numeric uid) against the given file contents.
pub fn resolve(spec: &str, passwd: &str, group: &str) -> Result<UserInfo, UserError> {
    let by_name = passwd_entries(passwd).find(|e| e.name == spec);
    let entry = match by_name {
        Some(e) => Some(e),
        None => match spec.parse::<u32>() {
            Ok(uid) => passwd_entries(passwd).find(|e| e.uid == uid),
            Err(_) => None,
        },
    };
    let (name, uid, gid, home) = match entry {
        Some(e) => (e.name.to_owned(), e.uid, e.gid, e.home.to_owned()),
        None => match spec.parse::<u32>() {
            // A uid without a passwd entry: its own group, no home.
            Ok(uid) => (spec.to_owned(), uid, uid, "/".to_owned()),
            Err(_) if spec == "root" => ("root".to_owned(), 0, 0, "/root".to_owned()),
            Err(_) => return Err(UserError::Unknown(spec.to_owned())),
        },
    };
    let mut groups = vec![gid];
    for line in group.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(g) = f[2].parse::<u32>() else { continue };
        if f[3].split(',').any(|m| m == name) && !groups.contains(&g) {
            groups.push(g);
        }
    }
    Ok(UserInfo {
        name,
        uid,
        gid,
        home,
        groups,
    })
}

/// Resolve `spec` against `<root>/etc/passwd` and `<root>/etc/group` (missing files are empty).
pub fn lookup(root: &Path, spec: &str) -> Result<UserInfo, UserError> {
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
    resolve(spec, &read("etc/passwd"), &read("etc/group"))
}

/// Names of uids and gids, from the sandbox's /etc/passwd and /etc/group as read once.
#[derive(Debug, Default)]
pub struct Names {
    users: std::collections::HashMap<u32, String>,
    groups: std::collections::HashMap<u32, String>,
}

impl Names {
    pub fn parse(passwd: &str, group: &str) -> Self {
        let users = passwd_entries(passwd)
            .map(|e| (e.uid, e.name.to_owned()))
            .collect();
        let groups = group
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(':').collect();
                (f.len() >= 3).then_some(())?;
                Some((f[2].parse().ok()?, f[0].to_owned()))
            })
            .collect();
        Self { users, groups }
    }

    pub fn read(root: &Path) -> Self {
        let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
        Self::parse(&read("etc/passwd"), &read("etc/group"))
    }

    /// Fills `e.owner` and `e.group` (the numbers where no name is known).
    pub fn name(&self, e: &mut space_proto::EntryInfo) {
        let or_number = |m: &std::collections::HashMap<u32, String>, id: u32| {
            m.get(&id).cloned().unwrap_or_else(|| id.to_string())
        };
        e.owner = or_number(&self.users, e.uid);
        e.group = or_number(&self.groups, e.gid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # comment\n\
        user:x:1000:1000:User,,,:/home/user:/bin/bash\n\
        broken:line\n\
        svc:x:998:997::/nonexistent:/usr/sbin/nologin\n";
    const GROUP: &str = "root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:user\n\
        svc:x:997:\nweird:x:abc:user\n";

    #[test]
    fn names_of_ids_and_numbers_for_unknown_ones() {
        let names = Names::parse(PASSWD, GROUP);
        let mut e = space_proto::EntryInfo {
            uid: 1000,
            gid: 27,
            ..Default::default()
        };
        names.name(&mut e);
        assert_eq!((e.owner.as_str(), e.group.as_str()), ("user", "sudo"));
        e.uid = 4242;
        e.gid = 4343;
        names.name(&mut e);
        assert_eq!((e.owner.as_str(), e.group.as_str()), ("4242", "4343"));
    }

    #[test]
    fn by_name_with_supplementary_groups() {
        let u = resolve("user", PASSWD, GROUP).unwrap();
        assert_eq!(
            u,
            UserInfo {
                name: "user".into(),
                uid: 1000,
                gid: 1000,
                home: "/home/user".into(),
                groups: vec![1000, 27, 999],
            }
        );
    }

    #[test]
    fn by_numeric_uid() {
        let u = resolve("998", PASSWD, GROUP).unwrap();
        assert_eq!((u.name.as_str(), u.uid, u.gid), ("svc", 998, 997));
        let u = resolve("4242", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (4242, 4242, "/"));
        assert_eq!(u.groups, vec![4242]);
    }

    #[test]
    fn unknown_name_is_an_error_root_has_a_fallback() {
        assert!(matches!(
            resolve("nobody-here", PASSWD, GROUP),
            Err(UserError::Unknown(_))
        ));
        let r = resolve("root", "", "").unwrap();
        assert_eq!((r.uid, r.gid, r.home.as_str()), (0, 0, "/root"));
    }
}
