import logging
import warnings

logger = logging.getLogger("loong_xpu")


def quiet_megatron() -> None:
    """Silence what megatron-core says that a Loong run has already decided. Call it before megatron
    is imported (this module imports none of it)."""
    # It warns at import about optional packages (apex, TE) that the layer-spec choice accounts
    # for, and GPTModel's deprecation is a known, documented choice (loong-models).
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=SyntaxWarning, message=r"invalid escape sequence")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine) (is|are) not installed")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)
    # Loong saves synchronously; megatron routes that through its (deprecated) async path.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").setLevel(logging.ERROR)
