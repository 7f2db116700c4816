"""GPU catalog: required GPUs and columns, honest capacities, user extension, clear errors."""
import math

import pytest

from lora_kit.plan import gpus
from lora_kit.plan.gpus import add_gpu, get_gpu, gpu_table, remove_user_gpus, resolve_prices
from lora_kit.settings import Settings

REQUIRED_GPUS = ["T4", "L4", "A10G", "RTX-4090", "RTX-6000-Ada", "L40S", "A100-40GB", "A100-80GB",
                 "H100-PCIe", "H100-SXM", "H200", "B200", "GB10"]


@pytest.fixture(autouse=True)
def _clean_user_rows():
    remove_user_gpus()
    yield
    remove_user_gpus()


def test_catalog_has_required_gpus_columns_and_sources():
    df = gpu_table()
    assert set(REQUIRED_GPUS) <= set(df["name"])
    assert set(gpus.COLUMNS) <= set(df.columns)
    assert df["source"].str.len().gt(10).all(), "every row names its datasheet"
    assert set(df["cpu_arch"]) <= {"x86-64", "ARM64"}
    assert get_gpu("GB10")["cpu_arch"] == "ARM64" and get_gpu("GB10")["memory_gb"] == 128
    assert (df["memory_bandwidth_gbs"] > 0).all()
    # every GPU except T4 (no bf16 tensor cores) has a dense bf16 figure; dense < the vendor's sparse figure
    assert df.drop(index="T4")["bf16_tflops"].gt(0).all() and math.isnan(get_gpu("T4")["bf16_tflops"])
    assert get_gpu("H100-SXM")["bf16_tflops"] == pytest.approx(1979 / 2)


def test_settings_gpus_are_in_catalog():
    s = Settings()
    for name in [s.gpu, *s.gpus]:
        assert get_gpu(name)["name"] == name


def test_capacity_uses_cuda_total_when_known_else_decimal_gb():
    a100 = get_gpu("A100-80GB")
    assert a100["capacity_bytes"] == 81920 * 2 ** 20  # 80 GiB as CUDA reports it
    h100 = get_gpu("H100-SXM")
    assert h100["capacity_bytes"] == 81559 * 2 ** 20 < 80 * 2 ** 30
    b200 = get_gpu("B200")  # no public nvidia-smi figure named: the smaller reading of "180 GB"
    assert math.isnan(b200["cuda_total_mib"]) and b200["capacity_bytes"] == 180 * 10 ** 9


def test_lookup_is_case_and_punctuation_insensitive():
    assert get_gpu("a100 80gb")["name"] == "A100-80GB"
    assert get_gpu("rtx4090")["name"] == "RTX-4090"


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(ValueError) as e:
        get_gpu("V100-64GB")
    assert "H100-SXM" in str(e.value) and "add_gpu" in str(e.value)


def test_add_gpu_and_extra_csv(tmp_path):
    row = add_gpu("RTX-5090", memory_gb=32, memory_bandwidth_gbs=1792, bf16_tflops=209.5, cpu_arch="x86-64")
    assert row["capacity_bytes"] == 32 * 10 ** 9 and "RTX-5090" in gpu_table()["name"].tolist()
    csv = tmp_path / "mine.csv"
    csv.write_text("name,memory_gb,memory_bandwidth_gbs,bf16_tflops,example_price_per_hour\n"
                   "MyCard,12,500,50,0.2\nL4,24,300,121,0.55\n")
    df = gpu_table(extra_csv=csv)
    assert df.loc["MyCard", "memory_gb"] == 12
    assert df.loc["L4", "example_price_per_hour"] == 0.55  # a user row replaces the shipped one
    assert gpu_table().loc["L4", "example_price_per_hour"] != 0.55  # ... only where asked for
    with pytest.raises(ValueError, match="unknown field"):
        add_gpu("X", memory_gb=1, memory_bandwidth_gbs=1, colour="red")
    with pytest.raises(ValueError, match="memory_gb must be a positive"):
        add_gpu("X", memory_gb=-1, memory_bandwidth_gbs=1)


def test_bad_catalog_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        gpu_table(extra_csv=tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("name,memory\nX,3\n")
    with pytest.raises(ValueError, match="lacks column"):
        gpu_table(extra_csv=bad)
    neg = tmp_path / "neg.csv"
    neg.write_text("name,memory_gb,memory_bandwidth_gbs,example_price_per_hour\nX,3,100,-1\n")
    with pytest.raises(ValueError, match="example_price_per_hour must be >= 0"):
        gpu_table(extra_csv=neg)


def test_prices_user_over_example_and_negative_rejected():
    p = resolve_prices(["H100-SXM", "L4", "GB10"], {"h100-sxm": 2.0})
    assert p["H100-SXM"] == 2.0
    assert p["L4"] == get_gpu("L4")["example_price_per_hour"]
    assert math.isnan(p["GB10"])  # owned hardware: no example price
    with pytest.raises(ValueError, match="non-negative"):
        resolve_prices(["L4"], {"L4": -0.5})
    with pytest.raises(ValueError, match="Unknown GPU"):
        resolve_prices(["L4"], {"Z9": 1.0})


def test_compute_capability_is_a_number_or_unknown_and_read_in_one_place():
    """The attention rules, the time model, the cuBLAS workspace and the CLI read it through gpus.compute_capability:
    text that is not a number is refused when the GPU is added; empty is unknown, each caller naming its default."""
    try:
        with pytest.raises(ValueError, match="compute_capability must be a number"):
            add_gpu("Odd-1", memory_gb=80, memory_bandwidth_gbs=2000, bf16_tflops=500, compute_capability="sm_90")
        row = add_gpu("Plain-1", memory_gb=80, memory_bandwidth_gbs=2000, bf16_tflops=500)
        assert gpus.compute_capability(row) is None and gpus.compute_capability("Plain-1", unknown=8.0) == 8.0
        add_gpu("Text-1", memory_gb=80, memory_bandwidth_gbs=2000, bf16_tflops=500, compute_capability="9.0")
        assert gpus.compute_capability("Text-1") == 9.0 == gpus.compute_capability("H200")
        from lora_kit.plan.planner import check_plan
        note = check_plan("llama-3.1-8b", "Plain-1", method="qlora", qlora_prepare="peft")["note"]
        assert "math kernel" in note  # judged as an 8.0 card, without a crash
    finally:
        remove_user_gpus()
