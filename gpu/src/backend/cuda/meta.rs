//! A step's bookkeeping as the kernels read it: one `i32` array, uploaded
//! with a single copy per step, holding for each token its id, position and
//! sequence, for each sequence where its block table starts, the rows whose
//! logits are wanted, and the block tables themselves.

use crate::backend::StepBatch;

/// The packed arrays of one step; offsets are in elements of [`StepMeta::data`].
#[derive(Debug, Default)]
pub struct StepMeta {
    /// Everything, in the order of the offsets below.
    pub data: Vec<i32>,
    /// Tokens in the step.
    pub tokens: usize,
    /// Logits rows wanted.
    pub rows: usize,
    /// Token ids.
    pub ids_at: usize,
    /// Token positions.
    pub pos_at: usize,
    /// Sequence index of each token.
    pub seq_at: usize,
    /// Start of each sequence's block table within the tables.
    pub table_start_at: usize,
    /// Token row (index in the step) of each wanted logits row.
    pub rows_at: usize,
    /// The block tables, one after the other.
    pub tables_at: usize,
}

impl StepMeta {
    /// Packs `batch`, reusing the storage. The batch must have been validated
    /// (ids, positions and block ids all fit in `i32` then).
    pub fn pack(&mut self, batch: &StepBatch<'_>) {
        let n = batch.token_count();
        let seqs = batch.seqs.len();
        let rows = batch.logits_count();
        self.tokens = n;
        self.rows = rows;
        self.ids_at = 0;
        self.pos_at = n;
        self.seq_at = 2 * n;
        self.table_start_at = 3 * n;
        self.rows_at = 3 * n + seqs;
        self.tables_at = 3 * n + seqs + rows;
        let d = &mut self.data;
        d.clear();
        d.extend(batch.seqs.iter().flat_map(|s| s.tokens.iter().map(|&t| t as i32)));
        d.extend(batch.seqs.iter().flat_map(|s| (0..s.tokens.len()).map(move |i| (s.start_pos + i) as i32)));
        d.extend(batch.seqs.iter().enumerate().flat_map(|(i, s)| std::iter::repeat_n(i as i32, s.tokens.len())));
        let mut start = 0;
        for s in &batch.seqs {
            d.push(start as i32);
            start += s.block_table.len();
        }
        let mut end = 0;
        for s in &batch.seqs {
            end += s.tokens.len();
            if s.wants_logits {
                d.push(end as i32 - 1);
            }
        }
        d.extend(batch.seqs.iter().flat_map(|s| s.block_table.iter().map(|&b| b as i32)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SeqChunk;

    #[test]
    fn a_mixed_step_packs_tokens_tables_and_wanted_rows() {
        // A prefill chunk of three tokens (not finishing its prompt) and a decode token.
        let batch = StepBatch {
            seqs: vec![
                SeqChunk { tokens: &[10, 11, 12], start_pos: 16, block_table: &[4, 7], wants_logits: false },
                SeqChunk { tokens: &[99], start_pos: 5, block_table: &[2], wants_logits: true },
            ],
        };
        let mut m = StepMeta::default();
        m.pack(&batch);
        let at = |o: usize, n: usize| m.data[o..o + n].to_vec();
        assert_eq!((m.tokens, m.rows), (4, 1));
        assert_eq!(at(m.ids_at, 4), [10, 11, 12, 99]);
        assert_eq!(at(m.pos_at, 4), [16, 17, 18, 5]);
        assert_eq!(at(m.seq_at, 4), [0, 0, 0, 1]);
        assert_eq!(at(m.table_start_at, 2), [0, 2]);
        assert_eq!(at(m.rows_at, 1), [3], "the last token of the second sequence");
        assert_eq!(at(m.tables_at, 3), [4, 7, 2]);
        assert_eq!(m.data.len(), m.tables_at + 3);
        // The kernels' slot arithmetic on these arrays: token 1 (position 17) of sequence 0.
        let (bs, t) = (16, 1);
        let (p, s) = (m.data[m.pos_at + t] as usize, m.data[m.seq_at + t] as usize);
        let table = m.tables_at + m.data[m.table_start_at + s] as usize;
        assert_eq!(m.data[table + p / bs] as usize * bs + p % bs, 7 * 16 + 1);
    }
}
