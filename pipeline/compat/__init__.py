"""Where qship meets the private side of its libraries: every attribute of llm-compressor,
compressed-tensors or transformers that qship replaces, or reads although the library keeps
it private, is here and nowhere else (tests/test_compat.py greps pipeline/ for it).

- `table.PATCHES`: one row per target -- why, the upstream issue if any, the test;
- `patching.patched(target, value)`: the one way to replace one, inside a block, checked
  first against the pinned signature (exit 1 naming the library and version otherwise);
- one module per library version (`llmcompressor_0_14`, `compressed_tensors_0_19`,
  `transformers_5`, `model_signing_1_1`) with the replacements, each taking what qship does at that point
  as a callback, so the library's names and signatures stay here.

It sits below every stage (quantize, evaluate and model use it) and imports only
`pipeline.errors`."""
