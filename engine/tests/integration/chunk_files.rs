//! Uncompressed chunks of local stores are read straight from their files;
//! every box read that way equals the same box read through zarrs' codec
//! pipeline (the stores are written by zarr-python, see `make_fixtures.py`),
//! and a chunk file of the wrong size is an error naming the chunk.

use crate::common;

use std::ops::Range;

use common::{fixture, repo_root, scratch};
use datafusion::execution::runtime_env::RuntimeEnv;
use rand::{Rng, SeedableRng};
use zarrfusion::zarr::ChunkBufferPool;
use zarrfusion::{ZarrDataset, ZarrTableOptions};

fn open(store: &str) -> ZarrDataset {
    ZarrDataset::open(store, &ZarrTableOptions::default(), &RuntimeEnv::default()).unwrap()
}

/// A random box inside `shape`, sometimes a whole dimension.
fn random_box(rng: &mut impl Rng, shape: &[u64]) -> Vec<Range<u64>> {
    shape
        .iter()
        .map(|&n| {
            if rng.random_bool(0.3) {
                return 0..n;
            }
            let start = rng.random_range(0..n);
            start..rng.random_range(start + 1..=n)
        })
        .collect()
}

#[test]
fn boxes_read_from_chunk_files_equal_the_codec_pipeline() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for store in ["raw_v2.zarr", "raw_v3.zarr"] {
        let dataset = open(&fixture(store));
        let table = dataset.table(None).unwrap();
        let shape = table.shape();
        let pool = ChunkBufferPool::new();
        assert_eq!(table.variables.len(), 3);
        for variable in &table.variables {
            assert!(
                variable.reads_chunk_files(),
                "{store}/{} should be read from its chunk files",
                variable.name()
            );
            let mut boxes: Vec<Vec<Range<u64>>> = vec![shape.iter().map(|&n| 0..n).collect()];
            boxes.extend((0..300).map(|_| random_box(&mut rng, &shape)));
            for ranges in boxes {
                let direct = variable.read(&ranges, &pool).unwrap();
                let pipeline = variable.read_through_codecs(&ranges).unwrap();
                assert_eq!(
                    direct.to_data(),
                    pipeline.to_data(),
                    "{store}/{} over {ranges:?}",
                    variable.name()
                );
            }
        }
    }
}

#[test]
fn compressed_and_big_endian_chunks_go_through_the_codecs() {
    for store in [
        "codec_v3_bytes_big_endian.zarr",
        "codec_v3_zstd.zarr",
        "v2_basic.zarr",
    ] {
        let table = open(&fixture(store)).table(None).unwrap();
        for variable in &table.variables {
            assert!(!variable.reads_chunk_files(), "{store}/{}", variable.name());
        }
    }
}

#[test]
fn a_chunk_file_of_the_wrong_size_names_the_chunk() {
    let dir = scratch("chunk-files");
    let copy = dir.join("raw.zarr");
    common::copy_dir(&repo_root().join("tests/fixtures/data/raw_v3.zarr"), &copy);
    let chunk = copy.join("q/c/1/0/1");
    let bytes = std::fs::read(&chunk).unwrap();
    std::fs::write(&chunk, &bytes[..bytes.len() - 4]).unwrap();
    let table = open(copy.to_str().unwrap()).table(None).unwrap();
    let q = table.variables.iter().find(|v| v.name() == "q").unwrap();
    let whole: Vec<Range<u64>> = table.shape().iter().map(|&n| 0..n).collect();
    let message = q
        .read(&whole, &ChunkBufferPool::new())
        .unwrap_err()
        .to_string();
    assert!(message.contains("q/c/1/0/1"), "{message}");
    assert!(message.contains("truncated or corrupt"), "{message}");
    // A box that does not touch that chunk reads.
    assert!(q.read(&[0..2, 0..9, 0..4], &ChunkBufferPool::new()).is_ok());
}
