"""The packed-batch contract: segment ids -> target, loss mask, positions, cu_seqlens."""
import torch

from mindspeed_pack.packing.segments import IGNORE_INDEX, build_packed_batch, segment_ids_from_eod

N = IGNORE_INDEX


def _row():
    # two samples (4 and 3 tokens) then 3 pads; labels aligned, first token of a sample -100
    ids = torch.tensor([[10, 11, 12, 13, 20, 21, 22, 0, 0, 0]])
    labels = torch.tensor([[N, N, 12, 13, N, 21, 22, N, N, N]])
    seg = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0, 0, 0]])
    return ids, labels, seg


def test_labels_shift_within_segments_only():
    ids, labels, seg = _row()
    b = build_packed_batch(ids, labels, seg)
    expected = [N, 12, 13, N, 21, 22, N, N, N, N]
    assert (b.loss_mask[0] == torch.tensor([t != N for t in expected]).float()).all()
    assert b.target[0][b.loss_mask[0].bool()].tolist() == [t for t in expected if t != N]


def test_last_token_never_predicts_next_sample_even_if_labelled():
    ids = torch.tensor([[1, 2, 3, 4]])
    labels = torch.tensor([[N, 2, 3, 4]])  # a (malformed) label on the next sample's first token
    seg = torch.tensor([[1, 1, 2, 2]])
    b = build_packed_batch(ids, labels, seg)
    assert b.loss_mask[0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_positions_restart_and_padding_is_one_segment():
    ids, labels, seg = _row()
    b = build_packed_batch(ids, labels, seg)
    assert b.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert b.cu_seqlens.tolist() == [0, 4, 7, 10]
    assert b.max_seqlen == 4 and b.num_samples == 2 and b.num_pad_tokens == 3


def test_positions_not_reset_when_disabled():
    ids, labels, seg = _row()
    b = build_packed_batch(ids, labels, seg, reset_position_ids=False)
    assert b.position_ids[0].tolist() == list(range(10))


def test_micro_batch_rows_flatten_into_one_thd_sequence():
    ids, labels, seg = _row()
    b = build_packed_batch(torch.cat([ids, ids]), torch.cat([labels, labels]), torch.cat([seg, seg]))
    assert b.tokens.shape == (1, 20)
    assert b.cu_seqlens.tolist() == [0, 4, 7, 10, 14, 17, 20]
    assert b.num_samples == 4


def test_no_segment_ids_means_one_causal_row():
    ids, labels, _ = _row()
    b = build_packed_batch(ids, labels, None)
    assert b.cu_seqlens.tolist() == [0, 10]
    assert b.position_ids[0].tolist() == list(range(10))


def test_per_sample_weights_average_each_sample_first():
    ids, labels, seg = _row()
    b = build_packed_batch(ids, labels, seg, per_sample_loss=True)
    w = b.loss_weights[0]
    assert torch.allclose(w[:4].sum(), torch.tensor(1.0)) and torch.allclose(w[4:7].sum(), torch.tensor(1.0))
    assert w[7:].sum() == 0


def test_segments_from_eod_close_each_document():
    tokens = torch.tensor([[5, 6, 0, 7, 0, 8, 9]])  # eod = 0
    assert segment_ids_from_eod(tokens, 0)[0].tolist() == [1, 1, 1, 2, 2, 3, 3]
