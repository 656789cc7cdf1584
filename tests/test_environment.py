"""nbaccel.utils.environment and nbaccel.utils.imports: env parsing, rank variables, notebooks, availability."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from packaging.version import Version

from nbaccel.utils import environment as env
from nbaccel.utils import imports

_RANK_VARS = [
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "PMI_RANK", "PMI_SIZE",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_NODE_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
]


@pytest.fixture
def no_rank_env(monkeypatch):
    for key in _RANK_VARS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize("text", ["y", "YES", "t", "True", "on", "1", " 1 "])
def test_str_to_bool_true(text):
    assert env.str_to_bool(text) == 1 and env.str_to_bool(text, to_bool=True) is True


@pytest.mark.parametrize("text", ["n", "No", "f", "FALSE", "off", "0"])
def test_str_to_bool_false(text):
    assert env.str_to_bool(text) == 0 and env.str_to_bool(text, to_bool=True) is False


def test_str_to_bool_rejects_other_text():
    with pytest.raises(ValueError, match="invalid truth value 'maybe'.*yes"):
        env.str_to_bool("maybe")


def test_parse_flag_from_env(monkeypatch):
    monkeypatch.delenv("NBACCEL_TEST_FLAG", raising=False)
    assert env.parse_flag_from_env("NBACCEL_TEST_FLAG") is False
    assert env.parse_flag_from_env("NBACCEL_TEST_FLAG", True) is True
    monkeypatch.setenv("NBACCEL_TEST_FLAG", "yes")
    assert env.parse_flag_from_env("NBACCEL_TEST_FLAG") is True
    monkeypatch.setenv("NBACCEL_TEST_FLAG", "0")
    assert env.parse_flag_from_env("NBACCEL_TEST_FLAG", True) is False
    monkeypatch.setenv("NBACCEL_TEST_FLAG", "sure")
    with pytest.raises(ValueError, match="NBACCEL_TEST_FLAG='sure'"):
        env.parse_flag_from_env("NBACCEL_TEST_FLAG")


def test_parse_choice_and_int_from_env(monkeypatch):
    monkeypatch.delenv("NBACCEL_TEST_CHOICE", raising=False)
    assert env.parse_choice_from_env("NBACCEL_TEST_CHOICE") == "no"
    assert env.parse_choice_from_env("NBACCEL_TEST_CHOICE", "bf16") == "bf16"
    monkeypatch.setenv("NBACCEL_TEST_CHOICE", "fp16")
    assert env.parse_choice_from_env("NBACCEL_TEST_CHOICE") == "fp16"
    monkeypatch.setenv("NBACCEL_A", "-1")
    monkeypatch.setenv("NBACCEL_B", "7")
    assert env.get_int_from_env(["NBACCEL_MISSING", "NBACCEL_A", "NBACCEL_B"], 3) == 7
    assert env.get_int_from_env(["NBACCEL_MISSING"], 3) == 3
    monkeypatch.setenv("NBACCEL_A", "seven")
    with pytest.raises(ValueError, match="NBACCEL_A='seven' must be an integer"):
        env.get_int_from_env(["NBACCEL_A"], 0)


def test_patch_environment_uppercases_and_restores_exactly(monkeypatch):
    monkeypatch.setenv("NBACCEL_KEEP", "old")
    monkeypatch.delenv("NBACCEL_NEW", raising=False)
    with env.patch_environment(nbaccel_keep="patched", NBACCEL_NEW=5):
        assert os.environ["NBACCEL_KEEP"] == "patched"
        assert os.environ["NBACCEL_NEW"] == "5"
        del os.environ["NBACCEL_KEEP"]  # the body may delete or change them: exit still restores
        os.environ["NBACCEL_NEW"] = "changed"
    assert os.environ["NBACCEL_KEEP"] == "old"
    assert "NBACCEL_NEW" not in os.environ
    with pytest.raises(RuntimeError), env.patch_environment(NBACCEL_NEW="x"):
        raise RuntimeError
    assert "NBACCEL_NEW" not in os.environ


def test_clear_environment_restores(monkeypatch):
    monkeypatch.setenv("NBACCEL_KEEP", "kept")
    before = dict(os.environ)
    with env.clear_environment():
        assert dict(os.environ) == {}
        os.environ["NBACCEL_ADDED"] = "1"
    assert dict(os.environ) == before


def test_purge_accelerate_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_KEEP", "a")

    @env.purge_accelerate_environment
    def sets_variables():
        os.environ["ACCELERATE_ADDED"] = "1"
        os.environ["NBACCEL_ADDED"] = "1"
        os.environ["ACCELERATE_KEEP"] = "changed"

    sets_variables()
    assert "ACCELERATE_ADDED" not in os.environ and "NBACCEL_ADDED" not in os.environ
    assert os.environ["ACCELERATE_KEEP"] == "a"


def test_purge_accelerate_environment_covers_derived_test_classes(monkeypatch):
    """Decorating a base test class purges its derived classes' tests too, each test method wrapped once,
    as with Accelerate's decorator (its own test_utils checks it on unittest and pytest classes)."""
    import accelerate.utils

    monkeypatch.delenv("ACCELERATE_SET", raising=False)
    for decorate in (accelerate.utils.purge_accelerate_environment, env.purge_accelerate_environment):
        @decorate
        class Base:
            def test_one(self):
                os.environ["ACCELERATE_SET"] = "1"

        class Derived(Base):
            def test_two(self):
                os.environ["ACCELERATE_SET"] = "2"

        for method in (Derived().test_one, Derived().test_two, Base().test_one):
            method()
            assert "ACCELERATE_SET" not in os.environ, decorate.__module__


def test_rank_info_plain_process(no_rank_env):
    info = env.get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.source) == (0, 1, 0, 1, "none")


def test_rank_info_torchrun_variables(no_rank_env):
    with env.patch_environment(RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1):
        info = env.get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.node_rank, info.num_nodes, info.source) == (1, 2, "torch")


def test_rank_info_derives_local_values(no_rank_env):
    with env.patch_environment(RANK=1, WORLD_SIZE=2):
        info = env.get_cpu_distributed_information()
    assert (info.local_rank, info.local_world_size, info.node_rank, info.num_nodes) == (1, 2, 0, 1)


def test_rank_info_open_mpi_variables(no_rank_env):
    with env.patch_environment(
        OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_RANK=1, OMPI_COMM_WORLD_LOCAL_SIZE=2
    ):
        info = env.get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.node_rank, info.num_nodes, info.source) == (1, 2, "mpi")


def test_rank_info_pmi_variables(no_rank_env):
    with env.patch_environment(PMI_RANK=1, PMI_SIZE=2):
        info = env.get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.local_rank, info.source) == (1, 2, 1, "mpi")


def test_torch_variables_win_over_mpi(no_rank_env):
    with env.patch_environment(RANK=0, WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=4):
        info = env.get_cpu_distributed_information()
    assert (info.rank, info.world_size, info.source) == (0, 2, "torch")


def test_rank_outside_world_is_an_error(no_rank_env):
    with env.patch_environment(RANK=2, WORLD_SIZE=2), pytest.raises(ValueError, match="RANK=2 is outside"):
        env.get_cpu_distributed_information()


def test_tpu_requested(monkeypatch):
    for key in ("PJRT_DEVICE", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR", "XRT_TPU_CONFIG",
                "TPU_WORKER_ID", "USE_TORCH_XLA"):
        monkeypatch.delenv(key, raising=False)
    assert not env.tpu_requested()
    monkeypatch.setenv("PJRT_DEVICE", "tpu")
    assert env.tpu_requested()
    monkeypatch.setenv("USE_TORCH_XLA", "0")
    assert not env.tpu_requested()
    monkeypatch.delenv("USE_TORCH_XLA")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert not env.tpu_requested()
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    assert env.tpu_requested()


def test_notebook_detection(monkeypatch):
    assert env.in_notebook() is False  # pytest is no Jupyter kernel
    for key in ("COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"):
        monkeypatch.delenv(key, raising=False)
    assert env.is_colab() is ("google.colab" in sys.modules)
    assert env.is_kaggle() is False
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20240101")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert env.is_colab() and env.is_kaggle()


def test_in_notebook_sees_a_kernel_shell(monkeypatch):
    ipython = pytest.importorskip("IPython")

    class ZMQInteractiveShell:
        config: dict = {}

    monkeypatch.setattr(ipython, "get_ipython", lambda: ZMQInteractiveShell())
    assert env.in_notebook() is True

    class TerminalInteractiveShell:
        config: dict = {}

    monkeypatch.setattr(ipython, "get_ipython", lambda: TerminalInteractiveShell())
    assert env.in_notebook() is False


# --- imports ---------------------------------------------------------------------------------------------


def test_compare_versions_and_torch_version():
    import torch

    assert imports.compare_versions(Version("2.1.0"), ">=", "2.0")
    assert imports.compare_versions("torch", ">=", Version(torch.__version__).base_version)
    assert imports.compare_versions("torch", "<", "999")
    assert imports.is_torch_version(">=", "2.0")
    assert not imports.is_torch_version("<", "1.0")
    with pytest.raises(ValueError, match="`operation` must be one of"):
        imports.compare_versions("torch", "~=", "2.0")
    with pytest.raises(ValueError, match="not an installed library"):
        imports.compare_versions("no_such_library_nbaccel", ">=", "1.0")


def test_package_checks_on_this_machine(monkeypatch):
    assert imports.is_safetensors_available() is True
    assert imports.is_tensorboard_available() is True
    assert imports.is_deepspeed_available() is False
    assert imports.is_torch_xla_available() is False
    assert imports.is_transformer_engine_available() is False
    assert imports.is_fp8_available() in (True, False)
    assert imports._is_package_available("no_such_library_nbaccel") is False
    monkeypatch.delenv("NBACCEL_ENABLE_RICH", raising=False)
    monkeypatch.delenv("ACCELERATE_ENABLE_RICH", raising=False)
    assert imports.is_rich_available() is False  # installed, but Accelerate's meaning needs the opt-in flag
    monkeypatch.setenv("ACCELERATE_ENABLE_RICH", "1")
    assert imports.is_rich_available() is True


def test_device_checks_on_a_cpu_machine():
    import torch

    assert imports.is_cuda_available() is torch.cuda.is_available()
    assert imports.is_bf16_available() is True  # bf16 runs on the CPU
    assert imports.is_fp16_available() is True
    assert imports.is_npu_available() is False and imports.is_xpu_available() in (True, False)
    with pytest.raises(ValueError):
        imports.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


def test_availability_checks_do_not_import_the_packages():
    code = (
        "import sys\n"
        "from nbaccel.utils import imports as i\n"
        "names = [n for n in dir(i) if n.startswith('is_') and n.endswith('_available') and n not in "
        "('is_bf16_available','is_cuda_available','is_mps_available','is_xpu_available','is_xccl_available',"
        "'is_torch_distributed_available','is_rocm_available','is_fp16_available','is_weights_only_available','is_pippy_available')]\n"
        "for n in names: getattr(i, n)()\n"
        "heavy = [m for m in ('tensorboard','matplotlib','pandas','sklearn','torch','safetensors') if m in sys.modules]\n"
        "print(len(names), heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    count, heavy = out.stdout.split(" ", 1)
    assert int(count) > 25
    assert heavy.strip() == "[]", out.stdout


def test_every_registered_utils_name_resolves():
    import nbaccel.utils as utils

    for module in (".environment", ".imports", ".random"):
        for name in utils._MODULES[module]:
            assert callable(getattr(utils, name)), name


def _fake_nvidia_smi(tmp_path, monkeypatch, names: list[str], driver: str, capability: str) -> None:
    """An `nvidia-smi` on PATH answering the queries nbaccel makes."""
    script = tmp_path / "nvidia-smi"
    lines = ["#!/bin/sh", 'case "$1" in', "  --query-gpu=name)"]
    lines += [f"    echo '{name}'" for name in names] + ["    ;;"]
    lines += [f"  --query-gpu=driver_version) echo {driver} ;;", f"  --query-gpu=compute_cap) echo {capability} ;;"]
    script.write_text("\n".join(lines + ["esac", ""]))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env.check_cuda_fp8_capability.cache_clear()


def test_gpu_queries_read_nvidia_smi(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"], "535.1", "8.9")
    assert env.get_gpu_info() == (["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"], 2)
    assert env.get_driver_version() == "535.1"
    assert env.check_cuda_p2p_ib_support() is False  # two RTX 40xx on an old driver: NCCL P2P must be off
    assert env.check_cuda_fp8_capability() is True
    _fake_nvidia_smi(tmp_path, monkeypatch, ["NVIDIA A100-SXM4-80GB"] * 2, "535.1", "8.0")
    assert env.check_cuda_p2p_ib_support() is True
    assert env.check_cuda_fp8_capability() is False
    env.check_cuda_fp8_capability.cache_clear()


def test_gpu_queries_without_a_driver(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(FileNotFoundError, match="nvidia-smi was not found"):
        env.get_gpu_info()
    assert env.check_cuda_p2p_ib_support() is True  # nothing to work around
    assert env.get_current_device_type() == ("cuda", "MULTI_GPU")
