"""The preprocessing cache follows the inputs' content, not their size and modification time."""
import os

from mindspeed_pack.data import toy


def test_input_edited_in_place_with_size_and_mtime_kept_is_rebuilt(tmp_path, run_preprocess, toy_alpaca_rows, read_indexed):
    rows = [dict(r) for r in toy_alpaca_rows[:20]]
    data = toy.write_dataset(tmp_path / "a.jsonl", rows)
    flags = dict(input=data, output_prefix=tmp_path / "out" / "a", prompt_type="qwen", seq_length=128)
    code, out, err = run_preprocess(**flags)
    assert code == 0 and "reusing" not in out, err
    before = read_indexed(tmp_path / "out" / "a_packed_input_ids_document")
    stat = data.stat()
    # the same number of bytes, another word, the old modification time
    rows[3]["output"] = rows[3]["output"].replace(rows[3]["output"][:4], rows[3]["output"][:4][::-1], 1)
    assert rows[3]["output"] != toy_alpaca_rows[3]["output"]
    toy.write_dataset(data, rows)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    code, out, err = run_preprocess(**flags)
    assert code == 0 and "reusing" not in out, err
    after = read_indexed(tmp_path / "out" / "a_packed_input_ids_document")
    assert [x.tolist() for x in after] != [x.tolist() for x in before]
    # a file only touched keeps its cache: the content is the same
    os.utime(data, ns=(stat.st_atime_ns + 10**9, stat.st_mtime_ns + 10**9))
    code, out, err = run_preprocess(**flags)
    assert code == 0 and "reusing cached output" in out, err
