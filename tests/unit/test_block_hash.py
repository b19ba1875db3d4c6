"""The block-hash contract: golden vectors, chaining, namespaces, and no torch import."""

import hashlib
import struct
import subprocess
import sys

from baton.engine.block_hash import hash_block, hash_blocks, namespace_for


def test_golden_vectors():
    # Pinned values: changing them breaks every prefix index and peer; bump HASH_VERSION instead.
    ns = namespace_for("fp-test", None)
    assert ns.hex() == "5f38e72b83476b3272e756eabe393fc0f558eb80f4059c974e596bf04dc944a0"
    hashes = hash_blocks(list(range(8)), 4, ns)
    assert [h.hex()[:16] for h in hashes] == ["58714269cb93bd62", "08b6ab40b5677270"]


def test_matches_the_documented_byte_layout():
    ns = namespace_for("fp-test", "s")
    expect_ns = hashlib.sha256(b"baton-ns-v1\0fp-test\0s").digest()
    assert ns == expect_ns
    first = hashlib.sha256(b"baton-block-v1" + bytes(32) + ns + struct.pack("<4I", 1, 2, 3, 4))
    assert hash_block(None, ns, [1, 2, 3, 4]) == first.digest()


def test_chain_and_partial_block():
    ns = namespace_for("fp", "salt")
    hs = hash_blocks([5, 6, 7, 8, 9, 10, 11], 4, ns)
    assert len(hs) == 1  # the partial second block has no hash
    assert hs[0] == hash_block(None, ns, [5, 6, 7, 8])
    two = hash_blocks([5, 6, 7, 8, 9, 10, 11, 12], 4, ns)
    assert two[1] == hash_block(two[0], ns, [9, 10, 11, 12])
    # same tokens after a different first block -> different hash (the chain commits to the past)
    other = hash_blocks([0, 6, 7, 8, 9, 10, 11, 12], 4, ns)
    assert other[1] != two[1]


def test_namespaces_separate_models_and_salts():
    toks = [1, 2, 3, 4]
    a = hash_block(None, namespace_for("m1", None), toks)
    assert a != hash_block(None, namespace_for("m2", None), toks)
    assert a != hash_block(None, namespace_for("m1", "tenant"), toks)
    assert namespace_for("m1", None) == namespace_for("m1", "")


def test_stable_across_processes_and_torch_free():
    code = ("import sys; from baton.engine.block_hash import hash_blocks, namespace_for;"
            "print(hash_blocks(list(range(8)), 4, namespace_for('fp-test'))[1].hex());"
            "print('torch' in sys.modules)")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True).stdout.split()
            for seed in ("1", "2")]
    assert outs[0] == outs[1]
    assert outs[0][1] == "False"
    assert outs[0][0] == hash_blocks(list(range(8)), 4, namespace_for("fp-test"))[1].hex()


def test_native_chain_equals_the_python_chain():
    import random

    from baton.engine import block_hash

    rng = random.Random(3)
    ids = [rng.randrange(1 << 20) for _ in range(16 * 40 + 5)]
    ns = namespace_for("fp", "salt")
    parent = hash_block(None, ns, [9] * 16)
    reference = []
    p = parent
    for i in range(0, 16 * 40, 16):
        p = hash_block(p, ns, ids[i : i + 16])
        reference.append(p)
    fast = block_hash.hash_chain(ids, 16, ns, parent)  # 40 blocks: the native path if built
    assert fast == b"".join(reference)
    assert block_hash.hash_blocks(ids, 16, ns, parent) == reference
    if block_hash._native() is None:  # no C compiler here: the Python path was checked
        return
    saved, block_hash._native_fn = block_hash._native_fn, None  # force the Python path
    try:
        assert block_hash.hash_chain(ids, 16, ns, parent) == fast
    finally:
        block_hash._native_fn = saved
