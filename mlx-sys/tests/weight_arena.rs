//! Weights in the huge-page arena (`kernels::weight_array`): the same bytes
//! and behaviour as an MLX array, errors for lengths that do not fill the
//! shape, live-byte accounting, huge pages asked for (and not, with
//! `MLXCEL_HUGE_PAGES=0`), pages handed back when a weight goes, and
//! allocation from several threads.

use std::process::Command;
use std::sync::Mutex;

use half::bf16;
use mlx_sys::kernels::{self, weight_arena_huge_pages, weight_arena_pages, weight_array};
use mlx_sys::{Array, Dtype};

/// Each test holds this while it has weights alive, so that
/// `the_arena_counts_live_weights` sees only its own.
static ARENA: Mutex<()> = Mutex::new(());

fn arena_to_myself() -> std::sync::MutexGuard<'static, ()> {
    ARENA.lock().unwrap_or_else(|e| e.into_inner())
}

fn bytes_of(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The system's transparent huge page mode: "always", "madvise" or "never".
fn thp_mode() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let start = text.find('[')? + 1;
    let end = text[start..].find(']')? + start;
    Some(text[start..end].to_string())
}

#[test]
fn weight_arrays_hold_the_bytes_and_take_part_in_ops() {
    let _arena = arena_to_myself();
    let values: Vec<f32> = (0..15).map(|i| i as f32 * 0.5 - 3.0).collect();
    let w = weight_array(&bytes_of(&values), &[3, 5], Dtype::Float32).unwrap();
    assert_eq!(w.shape(), vec![3, 5]);
    assert_eq!(w.dtype(), Dtype::Float32);
    assert_eq!(w.to_vec::<f32>().unwrap(), values);
    // An op reads it as any array; its result lives in MLX's own memory.
    let doubled = w.add(&Array::from_slice(&values, &[3, 5]).unwrap()).unwrap();
    let expected: Vec<f32> = values.iter().map(|v| 2.0 * v).collect();
    assert_eq!(doubled.to_vec::<f32>().unwrap(), expected);
    assert_eq!(w.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(), vec![-10.0, 2.5, 15.0]);

    let halves: Vec<bf16> = (0..8).map(|i| bf16::from_f32(i as f32 - 4.0)).collect();
    let raw: Vec<u8> = halves.iter().flat_map(|v| v.to_le_bytes()).collect();
    let h = weight_array(&raw, &[2, 4], Dtype::Bfloat16).unwrap();
    assert_eq!(h.to_vec::<bf16>().unwrap(), halves);

    let packed: Vec<u8> = (0..=255).collect();
    let u = weight_array(&packed, &[16, 4, 4], Dtype::Uint8).unwrap();
    assert_eq!(u.to_vec::<u8>().unwrap(), packed);
    assert_eq!(u.astype(Dtype::Uint32).unwrap().sum(&[0, 1, 2], false).unwrap().to_vec::<u32>().unwrap(), vec![255 * 128]);

    let empty = weight_array(&[], &[0, 4], Dtype::Float32).unwrap();
    assert_eq!(empty.shape(), vec![0, 4]);
    assert!(empty.to_vec::<f32>().unwrap().is_empty());
}

#[test]
fn a_length_that_does_not_fill_the_shape_is_an_error() {
    let _arena = arena_to_myself();
    let err = weight_array(&[0u8; 12], &[2, 2], Dtype::Float32).unwrap_err().to_string();
    assert!(err.contains("12 bytes") && err.contains("16"), "{err}");
    let err = weight_array(&[0u8; 4], &[-1, 4], Dtype::Uint8).unwrap_err().to_string();
    assert!(err.contains("negative"), "{err}");
}

#[test]
fn the_arena_counts_live_weights() {
    let _arena = arena_to_myself();
    const BYTES: usize = 8 << 20;
    let before = kernels::weight_arena_bytes();
    let big = weight_array(&vec![7u8; BYTES], &[1024, 8192], Dtype::Uint8).unwrap();
    let held = kernels::weight_arena_bytes();
    assert!(held >= before + BYTES, "{before} -> {held}");
    let view = big.slice_axis(0, 0, 2).unwrap();
    drop(big);
    // A view keeps the memory alive.
    assert!(kernels::weight_arena_bytes() >= before + BYTES);
    assert_eq!(view.to_vec::<u8>().unwrap(), vec![7u8; 2 * 8192]);
    drop(view);
    let after = kernels::weight_arena_bytes();
    assert_eq!(after, before, "after dropping the weight");
}

#[test]
fn huge_pages_are_asked_for_unless_turned_off() {
    let _arena = arena_to_myself();
    let big = weight_array(&vec![1u8; 8 << 20], &[8 << 20], Dtype::Uint8).unwrap();
    let pages = weight_arena_pages();
    let mode = thp_mode();
    if cfg!(target_os = "linux") && mode.as_deref().is_some_and(|m| m != "never") {
        assert!(weight_arena_huge_pages());
        assert!(pages.eligible >= 8 << 20, "{pages:?}");
    }
    drop(big);
    // MLXCEL_HUGE_PAGES=0: nothing asked for; with THP in `madvise` mode,
    // no arena mapping is then eligible.
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["--ignored", "--exact", "child_reports_huge_pages", "--nocapture", "--test-threads=1"])
        .env("MLXCEL_HUGE_PAGES", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find_map(|l| l.find("arena ").map(|at| &l[at..])).expect("the child reports");
    assert!(line.starts_with("arena asks=false"), "{line}");
    if mode.as_deref() == Some("madvise") {
        assert!(line.ends_with("eligible=0"), "{line}");
    }
}

#[test]
#[ignore = "run by huge_pages_are_asked_for_unless_turned_off with MLXCEL_HUGE_PAGES=0"]
fn child_reports_huge_pages() {
    let big = weight_array(&vec![1u8; 8 << 20], &[8 << 20], Dtype::Uint8).unwrap();
    println!("arena asks={} eligible={}", weight_arena_huge_pages(), weight_arena_pages().eligible);
    drop(big);
}

#[test]
fn threads_allocate_side_by_side() {
    let _arena = arena_to_myself();
    let handles: Vec<_> = (0..4u32)
        .map(|t| {
            std::thread::spawn(move || {
                (0..40u32)
                    .map(|i| {
                        let n = 1 + ((t * 7919 + i * 104_729) % 20_000) as usize;
                        let values: Vec<f32> = (0..n).map(|j| (t * 1_000_000 + i * 1000) as f32 + j as f32).collect();
                        (weight_array(&bytes_of(&values), &[n as i32], Dtype::Float32).unwrap(), values)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for handle in handles {
        for (array, values) in handle.join().unwrap() {
            assert_eq!(array.to_vec::<f32>().unwrap(), values);
        }
    }
}

#[test]
fn a_dropped_weight_hands_its_pages_back() {
    let _arena = arena_to_myself();
    if !cfg!(target_os = "linux") {
        return; // weight_arena_pages reads /proc/self/smaps
    }
    // A small neighbour keeps the chunk mapped while the big weight goes.
    let neighbour = weight_array(&[3u8; 4096], &[4096], Dtype::Uint8).unwrap();
    let before = weight_arena_pages().resident;
    let big = weight_array(&vec![5u8; 16 << 20], &[16 << 20], Dtype::Uint8).unwrap();
    let held = weight_arena_pages().resident;
    assert!(held >= before + (16 << 20), "{before} -> {held}");
    drop(big);
    let after = weight_arena_pages().resident;
    // At most the two pages it shares with its neighbours (2 MiB each when huge) stay.
    assert!(after <= before + (4 << 20), "{before} -> {held} -> {after}");
    assert_eq!(neighbour.to_vec::<u8>().unwrap(), vec![3u8; 4096]);
}

#[test]
fn a_weight_larger_than_a_chunk_leaves_its_neighbours_alone() {
    let _arena = arena_to_myself();
    // Arena chunks are 64 MiB: the big weight gets a mapping of its own, and
    // the weights before and after it share the ordinary chunk.
    let before = weight_array(&[1u8; 1000], &[1000], Dtype::Uint8).unwrap();
    let big = weight_array(&vec![2u8; 80 << 20], &[80 << 20], Dtype::Uint8).unwrap();
    let after = weight_array(&[3u8; 1000], &[1000], Dtype::Uint8).unwrap();
    assert_eq!(before.to_vec::<u8>().unwrap(), vec![1u8; 1000]);
    assert_eq!(after.to_vec::<u8>().unwrap(), vec![3u8; 1000]);
    let sum = big.astype(Dtype::Uint32).unwrap().sum(&[0], false).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(sum, vec![2 * (80 << 20) as u32]);
}
