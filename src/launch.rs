//! Ranks from the launchers people already use: torchrun (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`,
//! `SLURM_LOCALID`) and Open MPI (`OMPI_COMM_WORLD_RANK`,
//! `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`). The local rank
//! picks the GPU (and through it the nearest NICs,
//! [`Domain::open_near_gpu`](crate::Domain::open_near_gpu)).

#![forbid(unsafe_code)]

use std::fmt;

use crate::error::{Error, Result};

/// Which launcher set the variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Launcher {
    /// torchrun / torch.distributed.launch.
    Torchrun,
    /// Slurm's srun.
    Slurm,
    /// Open MPI's mpirun.
    OpenMpi,
}

impl Launcher {
    /// Its variables: rank, world size, local rank.
    fn vars(self) -> [&'static str; 3] {
        match self {
            Launcher::Torchrun => ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
            Launcher::Slurm => ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
            Launcher::OpenMpi => ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"],
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
            Launcher::OpenMpi => "Open MPI",
        })
    }
}

/// This process's place in a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rank {
    /// Its rank, `0..world_size`.
    pub rank: u32,
    /// How many ranks the job has.
    pub world_size: u32,
    /// Its rank on this machine: the GPU it uses (0 when the launcher does
    /// not say).
    pub local_rank: u32,
    /// Who said so.
    pub launcher: Launcher,
}

impl Rank {
    /// The rank the launcher that started this process gave it, from the
    /// environment: torchrun first (it also runs under Slurm and MPI), then
    /// Open MPI, then Slurm. `None` when no launcher's variables are set.
    ///
    /// # Errors
    /// [`Error::BadEnv`] naming the variable when one is set but not a
    /// number; [`Error::InvalidArgument`] when only some of a launcher's
    /// variables are set, or the rank is not below the world size.
    pub fn from_env() -> Result<Option<Rank>> {
        Rank::from_lookup(|name| std::env::var(name).ok())
    }

    /// As [`from_env`](Self::from_env), reading variables through `get`.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Rank>> {
        for launcher in [Launcher::Torchrun, Launcher::OpenMpi, Launcher::Slurm] {
            let [rank, size, local] = launcher.vars();
            let (r, s) = (get(rank), get(size));
            if r.is_none() && s.is_none() {
                continue;
            }
            let number = |name: &'static str, v: Option<String>| -> Result<u32> {
                let v = v.ok_or_else(|| {
                    Error::InvalidArgument(format!("{launcher}: {name} is not set, though {rank} or {size} is"))
                })?;
                v.trim().parse().map_err(|_| Error::BadEnv {
                    var: name,
                    value: v,
                    expected: "a rank (a number from 0)",
                })
            };
            let rank_v = number(rank, r)?;
            let world_size = number(size, s)?;
            let local_rank = match get(local) {
                Some(v) => number(local, Some(v))?,
                None => 0,
            };
            if world_size == 0 || rank_v >= world_size {
                return Err(Error::InvalidArgument(format!(
                    "{launcher}: {rank}={rank_v} is not below {size}={world_size}"
                )));
            }
            return Ok(Some(Rank { rank: rank_v, world_size, local_rank, launcher }));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn each_launcher_is_read_and_torchrun_wins_under_slurm() {
        let r = Rank::from_lookup(env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")])).unwrap().unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank, r.launcher), (3, 8, 1, Launcher::Torchrun));
        let r = Rank::from_lookup(env(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6"), ("SLURM_LOCALID", "2")]))
            .unwrap()
            .unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank, r.launcher), (5, 6, 2, Launcher::Slurm));
        let r =
            Rank::from_lookup(env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")])).unwrap().unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank, r.launcher), (0, 2, 0, Launcher::OpenMpi));
        // torchrun started by srun: torchrun's own ranks count.
        let both = env(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
        assert_eq!(Rank::from_lookup(both).unwrap().unwrap().launcher, Launcher::Torchrun);
        assert_eq!(Rank::from_lookup(env(&[])).unwrap(), None);
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (pairs, names) in [
            (&[("RANK", "x"), ("WORLD_SIZE", "2")][..], "RANK"),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")][..], "WORLD_SIZE=2"),
            (&[("RANK", "0")][..], "WORLD_SIZE is not set"),
            (&[("SLURM_NTASKS", "4")][..], "SLURM_PROCID is not set"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")][..], "WORLD_SIZE=0"),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")][..], "LOCAL_RANK"),
        ] {
            let e = Rank::from_lookup(env(pairs)).unwrap_err();
            assert!(e.to_string().contains(names), "{pairs:?}: {e}");
        }
        let e = Rank::from_lookup(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(matches!(e, Error::BadEnv { var: "RANK", ref value, .. } if value == "x"), "{e:?}");
    }
}
