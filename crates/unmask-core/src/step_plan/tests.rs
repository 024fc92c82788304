use super::*;

fn seq(rows: Range<usize>, refresh: bool, kv_base: usize) -> SeqStep {
    SeqStep {
        predict: rows.clone().map(|p| p as u32).collect(),
        rows: rows.into(),
        refresh,
        prefix_len: 6,
        seq_len: 20,
        kv_len: 20,
        kv_base,
    }
}

#[test]
fn one_sequence_keeps_its_own_rows() {
    let l = StepPlan::shared(&[seq(6..20, true, 0)], 1, 2, false).unwrap();
    assert_eq!(l.shallow.positions, (6..20).collect::<Vec<u32>>());
    assert_eq!(l.shallow.kv_rows, (0..14).collect::<Vec<u32>>());
    assert_eq!(l.deep.positions, (0..20).collect::<Vec<u32>>());
    assert_eq!(l.deep.kv_rows, (0..20).collect::<Vec<u32>>());
    assert_eq!(
        l.copies,
        vec![
            RowCopy::Boundary { dst: 0, rows: 6 },
            RowCopy::Shallow {
                src: 0,
                dst: 6,
                rows: 14
            }
        ]
    );
    assert_eq!(l.output, Output::Deep);
    assert_eq!(l.sampled[0][0], (6, 6));
    assert_eq!(l.sampled[0][13], (19, 19));
    assert_eq!(l.token_layer_passes(), 14 + 20);
}

#[test]
fn sequences_get_disjoint_rows_and_arena_windows() {
    // A refreshing sequence between two that compute one block each.
    let seqs = [
        seq(8..12, false, 0),
        seq(6..20, true, 20),
        seq(16..20, false, 40),
    ];
    let l = StepPlan::shared(&seqs, 1, 3, false).unwrap();
    assert_eq!(l.shallow.len(), 4 + 14 + 4);
    assert_eq!(l.deep.len(), 4 + 20 + 4);
    for (i, s) in seqs.iter().enumerate() {
        let (sh, dp) = (&l.shallow.windows[i], &l.deep.windows[i]);
        // Shallow arena rows lie inside the sequence's window (no prefix rows there).
        for r in sh.rows.clone() {
            let kv = l.shallow.kv_rows[r] as usize;
            assert!(kv >= s.kv_base && kv < s.kv_base + s.seq_len - s.prefix_len);
            assert_eq!(
                kv - s.kv_base + s.prefix_len,
                l.shallow.positions[r] as usize
            );
        }
        for r in dp.rows.clone() {
            let kv = l.deep.kv_rows[r] as usize;
            assert_eq!(kv, s.kv_base + l.deep.positions[r] as usize);
            assert!(kv < s.kv_base + s.seq_len);
        }
        // Every sampled row of the output holds the position it claims.
        for &(row, pos) in &l.sampled[i] {
            assert_eq!(l.deep.positions[row as usize], pos);
            assert!(dp.rows.contains(&(row as usize)));
        }
    }
    // Windows tile the rows in order, without gaps or overlaps.
    for w in [&l.shallow.windows, &l.deep.windows] {
        for pair in w.windows(2) {
            assert_eq!(pair[0].rows.end, pair[1].rows.start);
        }
    }
    assert_eq!(l.deep.windows[1].rows, 4..24);
    assert_eq!(l.copies.len(), 4);
}

#[test]
fn without_a_shared_prefix_one_pass_over_every_layer() {
    // A fast-dllm-dual cached step: block 8..12 of a 20-position sequence, all of it
    // attended to; the prefix length is ignored without a shared prefix.
    let s = SeqStep {
        rows: (8..12).into(),
        predict: vec![9, 11],
        ..seq(8..12, false, 0)
    };
    let l = StepPlan::alone(&[s], 4, false).unwrap();
    assert!(!l.shared_prefix && l.deep.is_empty() && l.copies.is_empty());
    assert_eq!(l.output, Output::Shallow);
    assert_eq!(l.shallow.positions, vec![8, 9, 10, 11]);
    assert_eq!(l.shallow.kv_rows, vec![8, 9, 10, 11]);
    assert_eq!(l.shallow.windows, SeqWindow::single(4, 20).to_vec());
    assert_eq!(l.sampled, vec![vec![(1, 9), (3, 11)]]);
    assert_eq!(l.token_layer_passes(), 16);
    // Prefix-arm's prefix-only pass sees only the prefix.
    let warm = SeqStep {
        rows: (0..6).into(),
        kv_len: 6,
        predict: vec![],
        ..seq(0..6, false, 0)
    };
    let l = StepPlan::alone(&[warm], 4, false).unwrap();
    assert_eq!(l.shallow.windows[0].kv_len, 6);
}

#[test]
fn a_prefix_read_by_every_layer_needs_no_deep_pass() {
    // Depth b = n_layers: every layer reads the entry; nothing is recomputed.
    let l = StepPlan::shared(&[seq(6..20, true, 0)], 3, 3, false).unwrap();
    assert!(l.shared_prefix && l.deep.is_empty() && l.copies.is_empty());
    assert_eq!(l.output, Output::Shallow);
    assert_eq!(l.shallow.kv_rows, (0..14).collect::<Vec<u32>>());
    assert_eq!(l.shallow.windows[0].kv_len, 14);
    assert_eq!(l.sampled[0][0], (0, 6));
    assert!(StepPlan::shared(&[seq(6..20, true, 0)], 4, 3, false).is_err());
    // Depth 0: the shallow pass is the embedding alone; every layer is deep.
    let l = StepPlan::shared(&[seq(6..20, true, 0)], 0, 3, false).unwrap();
    assert_eq!(l.deep.len(), 20);
    assert_eq!(l.token_layer_passes(), 20 * 3);
}

#[test]
fn impossible_plans_are_errors() {
    let outside = SeqStep {
        predict: vec![3],
        ..seq(6..20, false, 0)
    };
    let e = StepPlan::shared(&[outside], 1, 2, false).unwrap_err();
    assert!(e.0.contains("position 3"), "{e}");
    let into_prefix = seq(2..20, false, 0);
    assert!(StepPlan::shared(&[into_prefix], 1, 2, false).is_err());
    let past_end = seq(6..21, false, 0);
    assert!(StepPlan::alone(&[past_end], 2, false).is_err());
    let refresh_alone = seq(6..20, true, 0);
    assert!(StepPlan::alone(&[refresh_alone], 2, false).is_err());
}

#[test]
fn a_step_may_skip_rows() {
    // ACache's refresh: 0..4 and 10..14 computed, with anchors 5 and 8 of the span 4..10.
    let rows = RowSet::without_plus(0..14, 4..10, &[8, 5]);
    assert_eq!(rows.ranges(), &[0..4, 5..6, 8..9, 10..14]);
    assert_eq!((rows.len(), rows.first(), rows.end()), (10, Some(0), 14));
    assert_eq!(
        (rows.index_of(8), rows.index_of(10), rows.index_of(6)),
        (Some(5), Some(6), None)
    );
    assert_eq!(
        RowSet::from_ranges([3..5, 0..2, 1..4, 7..7]),
        RowSet::from(0..5)
    );
    let s = SeqStep {
        rows: rows.clone(),
        predict: vec![10, 13],
        prefix_len: 0,
        refresh: false,
        seq_len: 14,
        kv_len: 14,
        kv_base: 30,
    };
    let l = StepPlan::alone(std::slice::from_ref(&s), 2, false).unwrap();
    assert_eq!(
        l.shallow.positions,
        rows.iter().map(|p| p as u32).collect::<Vec<_>>()
    );
    assert_eq!(l.shallow.kv_rows[5], 38);
    assert_eq!(l.sampled[0], vec![(6, 10), (9, 13)]);
    // Shifted logits read position 9's row for 10, which the step does not compute.
    let l = StepPlan::alone(&[s], 2, true).unwrap();
    assert_eq!(l.sampled[0], vec![(6, 10), (8, 13)]);
}

#[test]
fn first_fit_finds_the_lowest_free_window() {
    assert_eq!(first_fit(&mut [], 10, 10), Some(0));
    assert_eq!(first_fit(&mut [], 11, 10), None);
    assert_eq!(first_fit(&mut [(0, 4), (10, 5)], 6, 20), Some(4));
    assert_eq!(first_fit(&mut [(10, 5), (0, 4)], 7, 20), None);
    assert_eq!(first_fit(&mut [(10, 5), (0, 4)], 5, 20), Some(4));
    assert_eq!(first_fit(&mut [(0, 4), (4, 6)], 10, 20), Some(10));
    assert_eq!(first_fit(&mut [(3, 4)], 3, 20), Some(0));
}

#[test]
fn batches_are_split_to_fit_one_state() {
    assert_eq!(split_by_rows(&[10, 10, 10], 30), vec![0..3]);
    assert_eq!(split_by_rows(&[10, 10, 10], 25), vec![0..2, 2..3]);
    assert_eq!(split_by_rows(&[40, 10, 10], 25), vec![0..1, 1..3]);
    assert_eq!(split_by_rows(&[10, 40, 10], 25), vec![0..1, 1..2, 2..3]);
    assert_eq!(split_by_rows(&[], 25), Vec::<Range<usize>>::new());
    let parts = split_by_rows(&[7; 20], 30);
    assert!(parts.iter().all(|r| r.len() == 4 || r.end == 20));
    assert_eq!(parts.iter().map(|r| r.len()).sum::<usize>(), 20);
}

/// Shifted logits (Dream): position p is predicted from the row of p - 1 whenever the
/// step computes it, also when p - 1 is a refreshed prefix row; otherwise from p's own.
#[test]
fn shifted_logits_read_the_row_before() {
    // Alone, computing positions 6..20: 6 has no computed row before it.
    let l = StepPlan::alone(
        &[seq(6..20, false, 0)].map(|mut s| {
            s.prefix_len = 0;
            s
        }),
        2,
        true,
    )
    .unwrap();
    assert_eq!(l.sampled[0][0], (0, 6));
    assert_eq!(l.sampled[0][1], (0, 7));
    assert_eq!(l.sampled[0][13], (12, 19));
    // Shared prefix of 6 refreshed in the deep layers: position 6 reads row 5.
    let l = StepPlan::shared(&[seq(6..20, true, 0)], 1, 2, true).unwrap();
    assert_eq!(l.sampled[0][0], (5, 6));
    assert_eq!(l.sampled[0][13], (18, 19));
    // Not refreshed: the deep pass holds only 6..20, so 6 reads its own row.
    let l = StepPlan::shared(&[seq(6..20, false, 0)], 1, 2, true).unwrap();
    assert_eq!(l.sampled[0][0], (0, 6));
    assert_eq!(l.sampled[0][1], (0, 7));
    // A block after a gap (dual cache): its first position reads its own row.
    let mut block = seq(12..16, true, 0);
    block.predict = vec![12, 13, 15];
    let l = StepPlan::shared(&[block], 1, 2, true).unwrap();
    // Deep rows: prefix 0..6 at rows 0..6, then 12..16 at rows 6..10.
    assert_eq!(l.sampled[0], vec![(6, 12), (6, 13), (8, 15)]);
    // Without the shift nothing moves.
    let l = StepPlan::shared(&[seq(6..20, true, 0)], 1, 2, false).unwrap();
    assert_eq!(l.sampled[0][0], (6, 6));
}
