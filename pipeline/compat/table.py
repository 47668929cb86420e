"""Every attribute of llm-compressor, compressed-tensors or transformers that qship replaces,
or reads although the library keeps it private: one row each, with why, the upstream issue
where one is filed, and the test that holds the patch to its purpose. tests/test_compat.py
checks every row against the installed (pinned) libraries at import, and that no module of
pipeline/ outside this package touches a library's private attribute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# replace: swapped inside a block by patching.patched, put back after
# override: a method a qship subclass overrides (quantize/autoround_modifier.py)
# read: a private value qship reads, or a function a replacement calls with these parameters
# state: a library's mutable table qship writes into and restores
# private: a pydantic private attribute qship reads on an instance
Kind = Literal["replace", "override", "read", "state", "private"]


@dataclass(frozen=True)
class Patch:
    target: str  # "module:Owner.attr", importable as written
    kind: Kind
    params: tuple[str, ...] | None  # the pinned signature; None: not a function
    why: str
    test: str
    upstream: str | None = None

    @property
    def attr(self) -> str:
        """The replaced attribute's name: the last part after the module's colon."""
        return self.target.partition(":")[2].rpartition(".")[2]


_LC = "llmcompressor"
_AWQ = f"{_LC}.modifiers.transform.awq:AWQModifier"
_GPTQ = f"{_LC}.modifiers.gptq"
_AR = f"{_LC}.modifiers.autoround:AutoRoundModifier"
_ATTN = "tests/test_attention_scales.py"
_Q = "tests/test_quantize.py"
_SCALE = "tests/test_scale.py"

PATCHES: tuple[Patch, ...] = (
    # -- llm-compressor 0.14 without an accelerator (llmcompressor_0_14.without_accelerator)
    Patch(
        f"{_LC}.pipelines.cache:IntermediatesCache.pin_memory",
        "replace",
        ("self", "batch_index", "input_names"),
        "pins cached activations: 'Cannot access accelerator device' on a CPU host",
        "tests/test_compat.py::test_a_changed_library_is_refused_naming_it_and_its_version",
    ),
    Patch(
        f"{_LC}.modifiers.transform.awq.base:_allreduce_data_sum",
        "replace",
        ("data",),
        "distributed AWQ all-reduces on current_accelerator(), None on a CPU host",
        f"{_SCALE}::test_two_processes_match_one",
    ),
    Patch(
        "compressed_tensors.offload.cache.dist_cpu:DistributedCPUCache.onload",
        "replace",
        ("self", "offloaded"),
        "a CPU rank's onloaded weight is the shared tensor: AWQ's in-place div_ ran once "
        "per rank (KL 0.069 instead of 0.031, 2 ranks)",
        f"{_SCALE}::test_two_processes_match_one",
    ),
    # -- multi-node: the device of `<accelerator>:<global rank>` (rank_local_device)
    *(
        Patch(
            f"{_LC}.{m}:get_main_device",
            "replace",
            (),
            "computes on <accelerator>:<global rank>, a GPU the second node lacks",
            f"{_SCALE}::test_two_nodes_through_rendezvous_flags (CPU: checks the signature)",
        )
        for m in ("utils.dev", "pipelines.sequential.pipeline", "pipelines.data_free.pipeline")
    ),
    # -- AWQ's grid search with less alive at once (awq_lean_grid_search)
    Patch(
        f"{_AWQ}._run_samples",
        "replace",
        ("self", "module"),
        "keeps every batch's (output, attention weights) tuple: cut to the output",
        f"{_Q}::test_awq_grid_search_drops_attention_weights_per_batch",
    ),
    Patch(
        f"{_AWQ}._compute_best_scale",
        "replace",
        ("self", "mapping", "fp16_outputs", "orig_layer_weights"),
        "builds every grid point's quantized outputs before the loss: made lazily",
        f"{_Q}::test_awq_grid_search_streams_quantized_outputs",
    ),
    Patch(
        f"{_AWQ}._parent_args_cache",
        "private",
        None,
        "the cached parent inputs the lean _run_samples iterates",
        f"{_Q}::test_awq_grid_search_drops_attention_weights_per_batch",
    ),
    # -- the query of a hooked attention observed (hooked_attention_stays_hooked)
    Patch(
        f"{_LC}.utils.helpers:use_eager_attention",
        "replace",
        ("model",),
        "forcing eager bypasses compressed-tensors' attention hook: q_scale uncalibrated",
        f"{_ATTN}::test_the_patch_is_what_calibrates_the_query",
    ),
    Patch(
        "transformers.configuration_utils:PreTrainedConfig._attn_implementation",
        "read",
        None,
        "the attention a model runs; transformers has no public reader",
        f"{_ATTN}::test_the_patch_is_what_calibrates_the_query",
    ),
    # -- what calibration measures (observing_calibration)
    Patch(
        f"{_LC}.utils.metric_logging:CompressionLogger.set_results",
        "replace",
        ("self", "name", "loss"),
        "GPTQ's per-module error, as it is logged",
        f"{_Q}::test_recipe_quantizes_as_planned",
    ),
    Patch(
        f"{_AWQ}._log_error_metrics",
        "replace",
        ("self",),
        "AWQ's per-mapping loss reduction, as it is logged",
        f"{_Q}::test_recipe_quantizes_as_planned",
    ),
    Patch(
        f"{_AWQ}._error_metrics",
        "private",
        None,
        "AWQ's results so far, stored with each finished layer for a resumed run",
        f"{_SCALE}::test_resume_after_a_kill",
    ),
    Patch(
        f"{_LC}.core:LifecycleCallbacks.sequential_epoch_end",
        "replace",
        ("modules", "kwargs"),
        "a decoder layer done: its time, progress, the resume store",
        f"{_SCALE}::test_resume_after_a_kill",
    ),
    # -- resume: a stored layer runs forward, hooks off (subgraph_forward_wrapped)
    Patch(
        f"{_LC}.pipelines.sequential.helpers:Subgraph.forward",
        "replace",
        ("self", "args", "kwargs"),
        "a restorable layer is loaded, not calibrated",
        f"{_SCALE}::test_resume_after_a_kill",
    ),
    # -- GPTQ rounding W4A8 weights to their served values (gptq_block_update_for)
    Patch(
        f"{_GPTQ}.base:assign_batches",
        "replace",
        ("module_list", "batched_quantization", "block_size"),
        "batches split into the modules the update selects and the others",
        "tests/test_w4a8_gptq.py::test_served_rounding_brings_each_layers_served_output_nearer",
    ),
    Patch(
        f"{_GPTQ}.base:prepare_batch",
        "replace",
        ("batch", "batch_qparams", "hessians_by_module", "num_samples_by_module"),
        "notes which kind of batch the block update runs on",
        "tests/test_w4a8_gptq.py::test_the_format_and_scales_are_the_same_the_rounding_is_not",
    ),
    Patch(
        f"{_GPTQ}.gptq_quantize:gptq_block_update",
        "replace",
        (
            "W1",
            "Hinv1",
            "Q1",
            "Err1",
            "losses1",
            "scale",
            "zero_point",
            "global_scale",
            "g_idx",
            "quant_args",
            "i1",
        ),
        "the block update gets neither module nor activation scheme",
        "tests/test_w4a8_gptq.py::test_served_rounding_brings_each_layers_served_output_nearer",
    ),
    Patch(
        f"{_GPTQ}.gptq_quantize:column_scale_window",
        "read",
        ("scale", "zero_point", "global_scale", "g_idx", "quant_args", "num_rows", "i1", "i2"),
        "each column's effective scale, for the replaced block update",
        "tests/test_w4a8_gptq.py::test_served_rounding_brings_each_layers_served_output_nearer",
    ),
    # -- AutoRound (quantize/autoround_modifier.py)
    Patch(
        f"{_LC}.modifiers.autoround.base:untie_word_embeddings",
        "replace",
        ("model",),
        "unties the embeddings of a model whose recipe quantizes neither",
        "tests/test_methods.py::test_autoround_keeps_tied_embeddings_tied",
    ),
    Patch(
        f"{_AR}._match_autoround_targets",
        "override",
        ("self", "model"),
        "the modules of this modifier only: one scheme per modifier",
        "tests/test_methods.py::test_autoround_tunes_each_module_at_its_own_scheme",
    ),
    Patch(
        f"{_AR}._postprocess_qparams",
        "override",
        ("self", "model", "llmc_registered_qparams"),
        "auto-round's unsigned zero point moved onto compressed-tensors' signed grid",
        "tests/test_methods.py::test_autoround_tunes_each_module_at_its_own_scheme",
    ),
    # -- MoE checkpoints read per expert (model/moe.py)
    Patch(
        f"{_LC}.modeling.moe.linearize:set_save_conversion_mapping",
        "replace",
        ("model", "save_mappings"),
        "set on from_pretrained's (model, loading info) tuple: set on the model",
        "tests/test_moe_loading.py::test_direct_load_equals_split_after_load_and_restores_the_table",
    ),
    Patch(
        "transformers.conversion_mapping:_checkpoint_conversion_mapping_cache",
        "state",
        None,
        "llm-compressor leaves its save mapping registered: restored after the load",
        "tests/test_moe_loading.py::test_direct_load_equals_split_after_load_and_restores_the_table",
    ),
    # -- the save of a model on one device (llmcompressor_0_14.device_map_only_when_offloaded)
    Patch(
        f"{_LC}.transformers.compression.compressed_tensors_utils:to_accelerate",
        "replace",
        ("model",),
        "writes an hf_device_map of 'cpu' entries for a model that is not offloaded: "
        "transformers warned 'Attempting to save a model with offloaded modules'",
        "tests/test_formats.py::test_a_model_on_one_device_is_not_saved_as_offloaded",
    ),
    # -- the save under --offload cpu (compressed_tensors_0_19.compress_module_then)
    Patch(
        "compressed_tensors.compressors.model_compressors.model_compressor:compress_module",
        "replace",
        ("module", "format"),
        "torch keeps each module's freed pinned blocks until the save ends: handed back",
        f"{_Q}::test_save_under_cpu_offload_releases_pinned_blocks_per_module",
    ),
    # -- evaluate's served attention (evaluate/numerics.py)
    Patch(
        "compressed_tensors.modeling.attention:QuantizedAttentionImpl._original_impl",
        "read",
        None,
        "the attention compressed-tensors' hooked attention wraps",
        f"{_ATTN}::test_evaluate_runs_the_attention_the_hook_wraps",
    ),
    Patch(
        "transformers.modeling_utils:ALL_ATTENTION_FUNCTIONS._local_mapping",
        "state",
        None,
        "whether a per-process override existed, to restore it exactly",
        "tests/test_served.py::test_fp8_query_rounding",
    ),
    # -- model-signing 1.1: the DSSE envelope over qship's statements (model_signing_1_1.py)
    *(
        Patch(
            f"model_signing._signing.sign_{kind}:Verifier._verify_signed_content",
            "read",
            ("self", "signature"),
            "verifies a bundle's envelope without model-signing's own manifest predicate",
            f"tests/test_attestation.py::test_{test}",
        )
        for kind, test in (
            ("ec_key", "private_key_signature"),
            ("certificate", "certificate_signature"),
        )
    ),
)
