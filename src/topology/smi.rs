//! `nvidia-smi topo -m` (and `-mp`) output, parsed.
//!
//! Layouts handled: the old one, whose columns name NICs by device
//! (`mlx5_0`), and the newer one with `NIC0`... columns and a "NIC
//! Legend" mapping them to devices; tabs or runs of spaces; the ANSI
//! underline codes nvidia-smi puts around headers; extra columns after the
//! devices (`CPU Affinity`, `NUMA Affinity`, `GPU NUMA ID`); NVLink
//! entries (`NV12`) between GPUs.

use std::collections::BTreeMap;

use super::pci::LinkClass;

/// What one `nvidia-smi topo -m` text says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SmiTopo {
    /// `GPU0`, `GPU1`, ...
    pub gpus: Vec<String>,
    /// NICs by device name where the text gives it (`mlx5_0`), else `NICn`.
    pub nics: Vec<String>,
    /// The class of every GPU x NIC pair, `(gpu, nic) -> class`.
    pub links: BTreeMap<(String, String), LinkClass>,
    /// Each GPU's NUMA affinity column, when present.
    pub gpu_numa: BTreeMap<String, i32>,
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn is_gpu(label: &str) -> bool {
    label.strip_prefix("GPU").is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// Parses the text. Returns `None` when it has no matrix header.
pub fn parse(text: &str) -> Option<SmiTopo> {
    let text = strip_ansi(text);
    let lines: Vec<&str> = text.lines().collect();

    // The header: the first line whose first token is GPU0 (it has no row label).
    let header_at = lines.iter().position(|l| l.split_whitespace().next() == Some("GPU0"))?;
    let columns: Vec<String> = lines[header_at]
        .split_whitespace()
        .take_while(|t| !matches!(*t, "CPU" | "NUMA" | "Affinity"))
        .map(str::to_owned)
        .collect();

    // The NIC legend, newer layout: "  NIC0: mlx5_0".
    let mut legend: BTreeMap<String, String> = BTreeMap::new();
    for l in &lines[header_at..] {
        if let Some((k, v)) = l.trim().split_once(':') {
            let k = k.trim();
            if k.strip_prefix("NIC").is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())) {
                legend.insert(k.to_owned(), v.trim().to_owned());
            }
        }
    }
    let name_of = |col: &str| legend.get(col).cloned().unwrap_or_else(|| col.to_owned());

    let mut topo = SmiTopo::default();
    for c in &columns {
        if is_gpu(c) {
            topo.gpus.push(c.clone());
        } else {
            topo.nics.push(name_of(c));
        }
    }

    for l in &lines[header_at + 1..] {
        let mut cells = l.split_whitespace();
        let Some(label) = cells.next() else { continue };
        if !is_gpu(label) {
            continue;
        }
        let cells: Vec<&str> = cells.collect();
        if cells.len() < columns.len() {
            continue;
        }
        for (col, cell) in columns.iter().zip(&cells) {
            if is_gpu(col) {
                continue;
            }
            if let Some(class) = LinkClass::parse(cell) {
                topo.links.insert((label.to_owned(), name_of(col)), class);
            }
        }
        // Affinity columns follow the device columns: CPU list, then NUMA node.
        if let Some(numa) = cells.get(columns.len() + 1).and_then(|s| s.parse::<i32>().ok()) {
            topo.gpu_numa.insert(label.to_owned(), numa);
        }
    }
    Some(topo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ansi_codes_are_stripped() {
        assert_eq!(strip_ansi("\u{1b}[4mGPU0\u{1b}[0m\tX"), "GPU0\tX");
    }

    #[test]
    fn garbage_has_no_matrix() {
        assert_eq!(parse("No devices were found\n"), None);
        assert_eq!(parse(""), None);
    }
}
