//! The log as a Merkle tree, hashed as RFC 6962 (Certificate Transparency)
//! hashes it: SHA-256, leaves `H(0x00 || data)`, nodes `H(0x01 || l || r)`,
//! and the tree of `n` leaves split at the largest power of two below `n`.
//! Pure: the tree's leaves come from the caller (`Subtrees` answers the hash
//! of any range of them), so the same code serves the checkpointer, `prove`
//! and the offline `audit`.
//!
//! A leaf is one event in log order (the order every log reader follows:
//! `(txid, position)` below the horizon, docs/audit.md); its data is the
//! event's position (8 bytes, big-endian) followed by the event's chain hash
//! as stored (64 ASCII hex digits). The chain hash already covers every
//! other column of the event, so the leaf binds the whole event to its
//! place in the log.

use sha2::{Digest, Sha256};

pub type Hash = [u8; 32];

/// Leaves per stored block (`jobledger.merkle_blocks`): a block is a
/// perfect subtree of height 8, so block-aligned ranges hash from the
/// blocks' roots alone.
pub const BLOCK_LEAVES: u64 = 256;
pub const BLOCK_HEIGHT: u32 = 8;

pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The leaf of the event at `position` whose chain hash is `event_hash`.
pub fn event_leaf(position: i64, event_hash: &str) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(position.to_be_bytes());
    h.update(event_hash.as_bytes());
    h.finalize().into()
}

/// The hash of the empty tree (no leaf yet).
pub fn empty_root() -> Hash {
    Sha256::digest([]).into()
}

/// The largest power of two strictly below `n` (n ≥ 2).
fn split(n: u64) -> u64 {
    debug_assert!(n >= 2);
    1 << (63 - (n - 1).leading_zeros())
}

/// The root of a whole list of leaf hashes (the specification; tests and
/// small trees).
pub fn root_of(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => empty_root(),
        1 => leaves[0],
        n => {
            let k = split(n as u64) as usize;
            node_hash(&root_of(&leaves[..k]), &root_of(&leaves[k..]))
        }
    }
}

/// The right edge of a growing tree: the roots of its perfect subtrees,
/// largest first. Appending is amortised O(1); memory is O(log n).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontier {
    size: u64,
    /// `(height, root)`: a subtree of 2^height leaves.
    peaks: Vec<(u32, Hash)>,
}

impl Frontier {
    pub fn new() -> Self {
        Frontier::default()
    }

    /// The frontier of a tree of `size` leaves from its peaks (largest first),
    /// as an export's manifest carries them; `None` when they do not add up.
    pub fn from_peaks(size: u64, peaks: Vec<Hash>) -> Option<Self> {
        let heights: Vec<u32> = (0..64).rev().filter(|b| size & (1 << b) != 0).collect();
        (heights.len() == peaks.len()).then(|| Frontier {
            size,
            peaks: heights.into_iter().zip(peaks).collect(),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn peaks(&self) -> Vec<Hash> {
        self.peaks.iter().map(|(_, h)| *h).collect()
    }

    pub fn push(&mut self, leaf: Hash) {
        self.push_subtree(0, leaf);
    }

    /// Appends a perfect subtree of 2^height leaves with root `root`; the
    /// tree's size must be a multiple of 2^height (blocks on whole blocks).
    pub fn push_subtree(&mut self, height: u32, root: Hash) {
        assert!(
            self.size % (1u64 << height) == 0,
            "a subtree of height {height} cannot follow {} leaves",
            self.size
        );
        let mut node = (height, root);
        while let Some(&(h, left)) = self.peaks.last() {
            if h != node.0 {
                break;
            }
            self.peaks.pop();
            node = (h + 1, node_hash(&left, &node.1));
        }
        self.peaks.push(node);
        self.size += 1 << height;
    }

    /// RFC 6962's MTH of the leaves pushed so far.
    pub fn root(&self) -> Hash {
        let mut it = self.peaks.iter().rev();
        let Some(&(_, last)) = it.next() else {
            return empty_root();
        };
        it.fold(last, |acc, (_, left)| node_hash(left, &acc))
    }
}

/// Answers the hash of the leaves in `[start, end)` of one tree. Only ranges
/// that RFC 6962's proofs ask for are asked: `start` a multiple of the
/// largest power of two not above `end - start`, or ending at the tree's size.
pub trait Subtrees {
    type Error;
    fn range_hash(&mut self, start: u64, end: u64) -> Result<Hash, Self::Error>;
}

/// A tree held in memory (tests, `audit`'s own segments).
pub struct Leaves<'a>(pub &'a [Hash]);

impl Subtrees for Leaves<'_> {
    type Error = std::convert::Infallible;
    fn range_hash(&mut self, start: u64, end: u64) -> Result<Hash, Self::Error> {
        Ok(root_of(&self.0[start as usize..end as usize]))
    }
}

/// RFC 6962 §2.1.1 PATH(m, D[n]): the audit path of leaf `m` in a tree of
/// `n` leaves, from the leaf up.
pub fn inclusion_path<S: Subtrees>(m: u64, n: u64, tree: &mut S) -> Result<Vec<Hash>, S::Error> {
    assert!(m < n, "leaf {m} is not in a tree of {n}");
    let mut path = vec![];
    // Walk down from the root, recording siblings, then reverse.
    let (mut start, mut end, mut m) = (0u64, n, m);
    while end - start > 1 {
        let k = split(end - start);
        if m < k {
            path.push(tree.range_hash(start + k, end)?);
            end = start + k;
        } else {
            path.push(tree.range_hash(start, start + k)?);
            start += k;
            m -= k;
        }
    }
    path.reverse();
    Ok(path)
}

/// RFC 9162 §2.1.3.2: does `path` prove `leaf` at index `m` in the tree of
/// `n` leaves with root `root`?
pub fn verify_inclusion(leaf: &Hash, m: u64, n: u64, path: &[Hash], root: &Hash) -> bool {
    if m >= n {
        return false;
    }
    let (mut f_n, mut s_n) = (m, n - 1);
    let mut r = *leaf;
    for p in path {
        if s_n == 0 {
            return false;
        }
        if f_n & 1 == 1 || f_n == s_n {
            r = node_hash(p, &r);
            if f_n & 1 == 0 {
                while f_n & 1 == 0 && f_n != 0 {
                    f_n >>= 1;
                    s_n >>= 1;
                }
            }
        } else {
            r = node_hash(&r, p);
        }
        f_n >>= 1;
        s_n >>= 1;
    }
    s_n == 0 && r == *root
}

/// RFC 6962 §2.1.2 PROOF(m, D[n]): that the tree of `n` leaves extends the
/// tree of its first `m` (0 < m ≤ n).
pub fn consistency_path<S: Subtrees>(m: u64, n: u64, tree: &mut S) -> Result<Vec<Hash>, S::Error> {
    assert!(0 < m && m <= n, "no consistency proof from {m} to {n}");
    let mut out = vec![];
    subproof(m, 0, n, true, tree, &mut out)?;
    Ok(out)
}

fn subproof<S: Subtrees>(
    m: u64,
    start: u64,
    end: u64,
    whole: bool,
    tree: &mut S,
    out: &mut Vec<Hash>,
) -> Result<(), S::Error> {
    let n = end - start;
    if m == n {
        if !whole {
            out.push(tree.range_hash(start, end)?);
        }
        return Ok(());
    }
    let k = split(n);
    if m <= k {
        subproof(m, start, start + k, whole, tree, out)?;
        out.push(tree.range_hash(start + k, end)?);
    } else {
        subproof(m - k, start + k, end, false, tree, out)?;
        out.push(tree.range_hash(start, start + k)?);
    }
    Ok(())
}

/// RFC 9162 §2.1.4.2: does `proof` show that the tree of `n` leaves with
/// root `new_root` extends the tree of `m` leaves with root `old_root`?
pub fn verify_consistency(m: u64, n: u64, old_root: &Hash, new_root: &Hash, proof: &[Hash]) -> bool {
    if m == 0 || m > n {
        return false;
    }
    if m == n {
        return proof.is_empty() && old_root == new_root;
    }
    let mut proof: Vec<Hash> = proof.to_vec();
    if m.is_power_of_two() {
        proof.insert(0, *old_root);
    }
    let Some((first, rest)) = proof.split_first() else {
        return false;
    };
    let (mut f_n, mut s_n) = (m - 1, n - 1);
    while f_n & 1 == 1 {
        f_n >>= 1;
        s_n >>= 1;
    }
    let (mut fr, mut sr) = (*first, *first);
    for c in rest {
        if s_n == 0 {
            return false;
        }
        if f_n & 1 == 1 || f_n == s_n {
            fr = node_hash(c, &fr);
            sr = node_hash(c, &sr);
            if f_n & 1 == 0 {
                while f_n & 1 == 0 && f_n != 0 {
                    f_n >>= 1;
                    s_n >>= 1;
                }
            }
        } else {
            sr = node_hash(&sr, c);
        }
        f_n >>= 1;
        s_n >>= 1;
    }
    fr == *old_root && sr == *new_root && s_n == 0
}

#[cfg(test)]
mod tests;
