//! fx-data CPU benchmarks: feature extraction (rows/s), batch assembly
//! against a plain memcpy of the same bytes (GB/s), and opening a large
//! memory-mapped feature file (set FX_BENCH_STORE_MB, default 256).

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fx_data::features::N_KNOWN;
use fx_data::{
    assemble, synthetic, BatchLayout, FeatureStore, FeatureTable, Normalizer, Rng, Sampler, SyntheticConfig,
};

fn feature_extraction(c: &mut Criterion) {
    let bars = synthetic::generate(&SyntheticConfig { bars: 20_000, ..Default::default() }).unwrap();
    let mut g = c.benchmark_group("features");
    g.throughput(Throughput::Elements((bars.len() - fx_data::features::WARMUP) as u64));
    g.sample_size(10);
    g.bench_function("compute_20k_bars", |b| b.iter(|| fx_data::features::compute(black_box(&bars), "bench").unwrap()));
    g.finish();
}

fn batch_assembly(c: &mut Criterion) {
    let table = synthetic::feature_table(&SyntheticConfig { bars: 20_000, ..Default::default() }).unwrap();
    let store = Arc::new(FeatureStore::from_table(table).unwrap());
    let norm = Normalizer::fit(&store, 0..10_000).unwrap();
    let mut g = c.benchmark_group("batch_assembly");
    for (b, l) in [(256usize, 64usize), (4096, 1)] {
        let layout = BatchLayout { batch_size: b, window: l, n_market: store.n_market() };
        let all = 0..store.rows();
        let sampler = Sampler::windows(std::slice::from_ref(&all), l, b, 1).unwrap();
        let starts = sampler.epoch_batches(0)[0].starts.clone();
        let mut out = vec![0.0f32; layout.buffer_len()];
        let bytes = (layout.buffer_len() * 4) as u64;
        g.throughput(Throughput::Bytes(bytes));
        let id = format!("B{b}_L{l}");
        g.bench_with_input(BenchmarkId::new("assemble_raw", &id), &starts, |bn, s| {
            bn.iter(|| assemble(&store, None, &layout, black_box(s), &mut out).unwrap())
        });
        g.bench_with_input(BenchmarkId::new("assemble_normalised", &id), &starts, |bn, s| {
            bn.iter(|| assemble(&store, Some(&norm), &layout, black_box(s), &mut out).unwrap())
        });
        // The same number of bytes as one contiguous memcpy (the ceiling).
        let src = &store.market()[..layout.buffer_len().min(store.market().len())];
        let mut dst = vec![0.0f32; src.len()];
        g.throughput(Throughput::Bytes((src.len() * 4) as u64));
        g.bench_with_input(BenchmarkId::new("memcpy", &id), &(), |bn, _| {
            bn.iter(|| dst.copy_from_slice(black_box(src)))
        });
    }
    g.finish();
}

fn store_open(c: &mut Criterion) {
    let mb: usize = std::env::var("FX_BENCH_STORE_MB").ok().and_then(|s| s.parse().ok()).unwrap_or(256);
    let f = 51;
    let row_bytes = (f + N_KNOWN + 1) * 4 + 16;
    let rows = mb * (1 << 20) / row_bytes;
    let mut rng = Rng::new(1);
    let table = FeatureTable {
        market: (0..rows * f).map(|_| rng.uniform() as f32).collect(),
        known: vec![0.5; rows * N_KNOWN],
        logret_next: vec![0.0; rows],
        close: vec![1.0; rows],
        timestamp: (0..rows as i64).collect(),
        feature_names: (0..f).map(|j| format!("f{j}")).collect(),
        source: "bench".into(),
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.safetensors");
    table.write(&path).unwrap();
    drop(table);
    let size = std::fs::metadata(&path).unwrap().len();
    let mut g = c.benchmark_group("feature_store");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(size));
    // Full open: map + header + validation (a finiteness scan reads every value).
    g.bench_function(format!("open_validate_{mb}MB"), |b| {
        b.iter(|| {
            let s = FeatureStore::open(black_box(&path)).unwrap();
            assert_eq!(s.copied_bytes(), 0, "zero-copy: nothing is copied at open");
            s.rows()
        })
    });
    g.finish();
}

criterion_group!(benches, feature_extraction, batch_assembly, store_open);
criterion_main!(benches);
