"""`accelerate.utils.megatron_lm` under its names. Megatron-LM is not driven by nbaccel: every name imports,
and using one raises (ImportError naming megatron-core when it is absent; see `nbaccel.utils.integration`)."""

from __future__ import annotations

from .integration import MEGATRON_LM

_CLASSES = ["AbstractTrainStep", "BertTrainStep", "GPTTrainStep", "T5TrainStep", "MegatronEngine",
            "MegatronLMDummyDataLoader", "MegatronLMDummyScheduler", "MegatronLMOptimizerWrapper",
            "MegatronLMSchedulerWrapper"]
_FUNCTIONS = ["avg_losses_across_data_parallel_group", "finish_mpu_init", "gather_across_data_parallel_groups",
              "initialize", "model_provider_func", "prepare_data_loader", "prepare_model_optimizer_scheduler",
              "prepare_optimizer", "prepare_scheduler"]
globals().update({name: MEGATRON_LM.cls(name, __name__) for name in _CLASSES})
globals().update({name: MEGATRON_LM.function(name) for name in _FUNCTIONS})
__all__ = _CLASSES + _FUNCTIONS

# --- the Megatron-LM names Accelerate keeps in utils.dataclasses ---------------------------------------------
MegatronLMPlugin = MEGATRON_LM.cls("MegatronLMPlugin", "nbaccel.utils.dataclasses")
# model type -> the function that fills the plugin from a model config (empty: none is registered here)
MODEL_CONFIGS_TO_MEGATRON_PARSERS: dict = {}


def add_model_config_to_megatron_parser(model_type: str):
    """Decorator registering a parser of `model_type` configs for the Megatron-LM plugin."""

    def register(func):
        MODEL_CONFIGS_TO_MEGATRON_PARSERS[model_type] = func
        return func

    return register


parse_bert_config = MEGATRON_LM.function("parse_bert_config")
parse_gpt2_config = MEGATRON_LM.function("parse_gpt2_config")
parse_t5_config = MEGATRON_LM.function("parse_t5_config")
parse_llama_config = MEGATRON_LM.function("parse_llama_config")
parse_glm4_moe_config = MEGATRON_LM.function("parse_glm4_moe_config")

# Accelerate's utils exposes the preparation functions under megatron_lm_* names too.
megatron_lm_initialize = globals()["initialize"]
megatron_lm_prepare_data_loader = globals()["prepare_data_loader"]
megatron_lm_prepare_model_optimizer_scheduler = globals()["prepare_model_optimizer_scheduler"]
megatron_lm_prepare_optimizer = globals()["prepare_optimizer"]
megatron_lm_prepare_scheduler = globals()["prepare_scheduler"]
