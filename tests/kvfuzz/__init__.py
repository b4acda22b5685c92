"""EDKV decoder fuzzing (docs/reliability.md): valid payloads from the real prefill pipeline, mutated in every
way a broken link or a hostile sender can, each fed through the decode engine's stream reader into its real KV
buffers and judged by an oracle. ``tools/adversarial/fuzz_kv.py`` runs it at scale; ``tests/test_kv_fuzz.py`` a fast
subset.

- ``draw``: where a case's choices come from (a seeded numpy generator, or hypothesis);
- ``seeds``: the valid payloads the cases start from;
- ``frames`` (transport damage), ``header_edits`` and ``chunk_edits`` (a sender's resealed edits): the mutations,
  each a ``mutant.Mutant``; ``mutations``: a case (seed, mutation, feeds);
- ``oracle``: feeds a case into the engine and checks what it did.
"""
