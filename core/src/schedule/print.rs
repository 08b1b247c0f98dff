//! Prints a [`Program`] as a schedule file in canonical form.

use std::fmt;

use super::{P2p, Program, Stmt, StmtKind};

impl fmt::Display for P2p {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {}", self.dir.name(), self.peer, self.size)?;
        if let Some(c) = &self.comm {
            write!(f, " comm={c}")?;
        }
        if let Some(s) = &self.stream {
            write!(f, " stream={s}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Stmt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.kind.fmt(f)
    }
}

impl fmt::Display for StmtKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stream = |s: &Option<String>| match s {
            Some(s) => format!(" stream={s}"),
            None => String::new(),
        };
        match self {
            StmtKind::Op(op) => op.fmt(f),
            StmtKind::Group(ops) => {
                f.write_str("group { ")?;
                for (i, op) in ops.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    op.fmt(f)?;
                }
                f.write_str(" }")
            }
            StmtKind::Record { event, stream: s } => write!(f, "record {event}{}", stream(s)),
            StmtKind::Wait { event, stream: s } => write!(f, "wait {event}{}", stream(s)),
            StmtKind::Sync { stream: None } => f.write_str("sync"),
            StmtKind::Sync { stream: Some(s) } => write!(f, "sync {s}"),
            StmtKind::Notify { peer, tag } => write!(f, "notify {peer} {tag}"),
            StmtKind::Await { peer, tag } => write!(f, "await {peer} {tag}"),
        }
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "ranks {}", self.ranks)?;
        match self.copy_from {
            Some(c) => writeln!(f, "policy {} copy-from={c}", self.policy)?,
            None => writeln!(f, "policy {}", self.policy)?,
        }
        writeln!(f, "model {}", self.model)?;
        for c in &self.comms {
            write!(f, "comm {}", c.name)?;
            for r in &c.ranks {
                write!(f, " {r}")?;
            }
            writeln!(f)?;
        }
        for t in &self.threads {
            match &t.name {
                None => writeln!(f, "rank {}:", t.rank)?,
                Some(n) => writeln!(f, "rank {} thread {n}:", t.rank)?,
            }
            for s in &t.body {
                writeln!(f, "  {s}")?;
            }
        }
        Ok(())
    }
}
