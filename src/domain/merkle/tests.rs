use super::*;
use proptest::prelude::*;

fn h(s: &str) -> Hash {
    hex::decode(s).unwrap().try_into().unwrap()
}

/// The Certificate Transparency reference inputs and tree heads (sizes 0..=8).
const INPUTS: [&str; 8] = [
    "",
    "00",
    "10",
    "2021",
    "3031",
    "40414243",
    "5051525354555657",
    "606162636465666768696a6b6c6d6e6f",
];
const ROOTS: [&str; 9] = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
];

fn reference_leaves() -> Vec<Hash> {
    INPUTS
        .iter()
        .map(|i| leaf_hash(&hex::decode(i).unwrap()))
        .collect()
}

#[test]
fn the_reference_tree_heads() {
    let leaves = reference_leaves();
    for n in 0..=8 {
        assert_eq!(root_of(&leaves[..n]), h(ROOTS[n]), "size {n}");
        let mut f = Frontier::new();
        leaves[..n].iter().for_each(|l| f.push(*l));
        assert_eq!(f.root(), h(ROOTS[n]), "frontier, size {n}");
    }
}

#[test]
fn the_reference_inclusion_path() {
    let leaves = reference_leaves();
    let path = inclusion_path(0, 8, &mut Leaves(&leaves)).unwrap();
    let want = [
        "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
        "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
        "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
    ];
    assert_eq!(path, want.map(h).to_vec());
    assert!(verify_inclusion(&leaves[0], 0, 8, &path, &h(ROOTS[8])));
}

fn leaves(n: usize, salt: u8) -> Vec<Hash> {
    (0..n)
        .map(|i| leaf_hash(&[salt, (i % 251) as u8, (i / 251) as u8]))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Every leaf of every tree is proved, and a proof for anything else
    /// (another leaf, index, size or root) is refused.
    #[test]
    fn inclusion(n in 1usize..300, pick in any::<prop::sample::Index>(), salt in any::<u8>()) {
        let ls = leaves(n, salt);
        let root = root_of(&ls);
        let m = pick.index(n);
        let path = inclusion_path(m as u64, n as u64, &mut Leaves(&ls)).unwrap();
        prop_assert!(verify_inclusion(&ls[m], m as u64, n as u64, &path, &root));
        let other = leaf_hash(b"not in the log");
        prop_assert!(!verify_inclusion(&other, m as u64, n as u64, &path, &root));
        if n > 1 {
            let m2 = (m + 1) % n;
            prop_assert!(!verify_inclusion(&ls[m], m2 as u64, n as u64, &path, &root) || ls[m] == ls[m2]);
        }
        let mut bad = path.clone();
        if let Some(first) = bad.first_mut() {
            first[0] ^= 1;
            prop_assert!(!verify_inclusion(&ls[m], m as u64, n as u64, &bad, &root));
        }
    }

    /// A tree extends every prefix of itself, and no tree whose prefix was
    /// changed (the attacker's recomputed chain) is shown to extend it.
    #[test]
    fn consistency(n in 1usize..300, pick in any::<prop::sample::Index>(), salt in any::<u8>()) {
        let ls = leaves(n, salt);
        let m = pick.index(n) + 1;
        let (old, new) = (root_of(&ls[..m]), root_of(&ls));
        let proof = consistency_path(m as u64, n as u64, &mut Leaves(&ls)).unwrap();
        prop_assert!(verify_consistency(m as u64, n as u64, &old, &new, &proof));
        let mut rewritten = ls.clone();
        rewritten[pick.index(m)][0] ^= 1;
        let forged_new = root_of(&rewritten);
        let forged = consistency_path(m as u64, n as u64, &mut Leaves(&rewritten)).unwrap();
        prop_assert!(!verify_consistency(m as u64, n as u64, &old, &forged_new, &forged));
        if m < n {
            prop_assert!(!verify_consistency(m as u64, n as u64, &new, &new, &proof));
        }
    }

    /// The frontier's root is the specification's, at every size, and its
    /// peaks rebuild it.
    #[test]
    fn frontier(n in 0usize..600, salt in any::<u8>()) {
        let ls = leaves(n, salt);
        let mut f = Frontier::new();
        for (i, l) in ls.iter().enumerate() {
            f.push(*l);
            if i % 37 == 0 {
                prop_assert_eq!(f.root(), root_of(&ls[..=i]));
            }
        }
        prop_assert_eq!(f.root(), root_of(&ls));
        // Whole blocks pushed as subtrees give the same tree.
        let mut blocks = Frontier::new();
        let whole = n - n % 16;
        for chunk in ls[..whole].chunks(16) {
            blocks.push_subtree(4, root_of(chunk));
        }
        ls[whole..].iter().for_each(|l| blocks.push(*l));
        prop_assert_eq!(blocks.root(), f.root());
        let again = Frontier::from_peaks(n as u64, f.peaks()).unwrap();
        prop_assert_eq!(again.root(), f.root());
        let mut more = f.peaks();
        more.push(leaf_hash(b"x"));
        prop_assert!(Frontier::from_peaks(n as u64, more).is_none());
    }
}
