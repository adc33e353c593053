"""Models from a Hugging Face config.json, accelerators from a file, and the new built-in GPUs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from carpool.cli import main
from carpool.tune import gpu_file, hardware, hf_config, models
from carpool.tune.cost import RooflineCost, StepShape

LLAMA_31_8B = {"_name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16", "rope_theta": 500000.0}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32768, "tie_word_embeddings": False}
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
             "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "head_dim": 128,
                 "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4, "vocab_size": 151936,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "tie_word_embeddings": False}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
           "num_experts_per_tok": 2}


def write(tmp_path, name: str, cfg: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder / "config.json")


@pytest.mark.parametrize("name, cfg, total, active", [
    # The parameter counts their model cards publish.
    ("llama", LLAMA_31_8B, 8.03e9, 8.03e9),
    ("mistral", MISTRAL_7B, 7.25e9, 7.25e9),
    ("qwen25", QWEN25_7B, 7.62e9, 7.62e9),
    ("qwen3moe", QWEN3_30B_A3B, 30.5e9, 3.3e9),
    ("mixtral", MIXTRAL, 46.7e9, 12.9e9),
])
def test_config_json_gives_the_published_parameter_count(tmp_path, name, cfg, total, active):
    spec = hf_config.load(write(tmp_path, name, cfg))
    assert spec.num_params == pytest.approx(total, rel=0.01)
    assert spec.active_params == pytest.approx(active, rel=0.02)


def test_simulate_reads_a_config_json_and_names_its_repository(tmp_path, capsys):
    path = write(tmp_path, "Llama-3.1-8B-Instruct", LLAMA_31_8B)
    rc = main(["simulate", "--gpu", "h100", "--model-config", path, "--qps", "4", "--num-requests", "30", "--json"])
    assert rc == 0
    meta = json.loads(capsys.readouterr().out)["meta"]["cost_model"]
    assert meta["model"] == "Llama-3.1-8B-Instruct"
    assert meta["weights_gb_per_gpu"] == pytest.approx(16.06, rel=0.01)  # bf16: two bytes a weight


def test_a_config_json_missing_a_field_is_refused_naming_it(tmp_path, capsys):
    broken = {k: v for k, v in LLAMA_31_8B.items() if k != "num_hidden_layers"}
    assert main(["simulate", "--model-config", write(tmp_path, "broken", broken)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_an_mixture_of_experts_step_reads_the_experts_its_tokens_reach():
    cost = RooflineCost(hardware.get("h100"), models.get("mixtral-8x7b"), num_gpus=2)
    one, many = (cost.weight_bytes_per_gpu(n) for n in (1, 256))
    assert one < 0.4 * many  # one token touches 2 of 8 experts; 256 tokens touch all of them
    assert many == pytest.approx(cost.weight_bytes_per_gpu(), rel=0.01)
    # Decoding one sequence reads about a 13B model's weights, not 47B's.
    dense = RooflineCost(hardware.get("h100"), models.get("llama-3-70b"), num_gpus=2)
    decode = StepShape(0, 1, 512, 512, 1, num_logits=1)
    assert cost.step_time(decode) < 0.5 * dense.step_time(decode)


def test_fp8_weights_halve_the_bytes_and_use_fp8_tensor_cores_where_there_are_some():
    bf16, fp8 = models.get("llama-3.1-405b"), models.get("llama-3.1-405b-fp8")
    assert fp8.weight_bytes() == pytest.approx(bf16.weight_bytes() / 2)
    prefill = StepShape(8192, 0, 8192, 8192 * 4096, 1, num_logits=1)
    mi300x = hardware.get("mi300x")
    assert RooflineCost(mi300x, fp8, 8).parts(prefill)["linear_compute_s"] == pytest.approx(
        RooflineCost(mi300x, bf16, 8).parts(prefill)["linear_compute_s"] / 2, rel=0.01)
    a100 = hardware.get("a100-80gb")  # no fp8 tensor cores: fp8 weights are computed in bf16
    assert RooflineCost(a100, fp8, 8).parts(prefill)["linear_compute_s"] == pytest.approx(
        RooflineCost(a100, bf16, 8).parts(prefill)["linear_compute_s"], rel=0.01)


@pytest.mark.parametrize("quantization, weight_bytes", [
    ({"quant_method": "awq", "bits": 4}, 0.5), ({"quant_method": "gptq", "bits": 4}, 0.5),
    ({"quant_method": "gptq", "bits": 8}, 1.0),
])
def test_weight_only_quantization_reads_narrow_weights_and_multiplies_them_at_the_bf16_peak(
        quantization, weight_bytes):
    """AWQ and GPTQ store 4 or 8 bits a weight and widen each tile to 16 bits for the tensor
    cores: a decode reads a quarter or half the bytes, a prefill runs at the bf16 peak, not at the
    fp8 one an fp8 checkpoint of the same size gets."""
    quantized = hf_config.spec_from_dict({**LLAMA_31_8B, "quantization_config": quantization})
    bf16 = hf_config.spec_from_dict(LLAMA_31_8B)
    assert quantized.weight_only and not bf16.weight_only
    h100 = hardware.get("h100")
    decode = StepShape(0, 1, 1, 1, 1, num_logits=1)
    assert RooflineCost(h100, quantized).parts(decode)["linear_memory_s"] == pytest.approx(
        RooflineCost(h100, bf16).parts(decode)["linear_memory_s"] * weight_bytes / 2, rel=0.01)
    prefill = StepShape(8192, 0, 8192, 8192 * 4096, 1, num_logits=1)
    assert RooflineCost(h100, quantized).parts(prefill)["linear_compute_s"] == pytest.approx(
        RooflineCost(h100, bf16).parts(prefill)["linear_compute_s"], rel=0.01)
    fp8 = hf_config.spec_from_dict({**LLAMA_31_8B, "quantization_config": {"quant_method": "fp8"}})
    assert not fp8.weight_only
    assert RooflineCost(h100, fp8).parts(prefill)["linear_compute_s"] == pytest.approx(
        RooflineCost(h100, bf16).parts(prefill)["linear_compute_s"] / 2, rel=0.01)


def test_new_accelerators_carry_their_datasheet_figures():
    assert hardware.get("RTX 4090").mem_bandwidth_gbs == 1008 and hardware.get("4090").memory_gb == 24
    assert hardware.get("l40s").bf16_tflops == pytest.approx(362.05) and hardware.get("l40s").memory_gb == 48
    mi = hardware.get("MI300X")
    assert (mi.memory_gb, mi.mem_bandwidth_gbs, mi.vendor) == (192, 5300, "amd")
    # Faster memory decodes faster: the same 8B model on the three.
    decode = StepShape(0, 8, 8 * 512, 8 * 512, 8, num_logits=8)
    times = [RooflineCost(hardware.get(g), models.get("8b")).step_time(decode) for g in ("l40s", "rtx4090", "mi300x")]
    assert times == sorted(times, reverse=True)


def test_a_gpu_file_describes_any_other_part(tmp_path, capsys):
    a40 = tmp_path / "a40.yaml"
    a40.write_text("name: A40\nmemory_gb: 48\nmem_bandwidth_gbs: 696\nbf16_tflops: 149.7\n")
    rc = main(["simulate", "--gpu", str(a40), "--model-size", "8b", "--qps", "2", "--num-requests", "20", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["meta"]["cost_model"]["accelerator"] == "A40"


@pytest.mark.parametrize("body, field", [
    ("memory_gb: 48\nbf16_tflops: 149.7\n", "mem_bandwidth_gbs"),  # missing
    ("memory_gb: 48\nmem_bandwidth_gbs: -5\nbf16_tflops: 149.7\n", "mem_bandwidth_gbs"),  # out of range
    ("memory_gb: 48\nmem_bandwidth_gbs: 696\nbf16_tflops: 149.7\nbandwith_gbs: 1\n", "bandwith_gbs"),  # misspelt
    ('{"memory_gb": "lots", "mem_bandwidth_gbs": 696, "bf16_tflops": 149.7}', "memory_gb"),  # JSON, not a number
    ("memory_gb: 48\nmem_bandwidth_gbs: 696\nbf16_tflops: 149.7\nmeasured_matmul_tflops: 299.4\n",
     "measured_matmul_tflops"),  # the sparse figure given as a measurement
])
def test_a_bad_gpu_file_is_refused_naming_the_field(tmp_path, capsys, body, field):
    path = tmp_path / ("gpu.json" if body.startswith("{") else "gpu.yaml")
    path.write_text(body)
    assert main(["simulate", "--gpu", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and str(path) in err


def test_a_part_measured_below_its_datasheet_runs_slower_than_one_that_was_not(tmp_path):
    """The MI300X's datasheet is taken at the share of it a microbenchmark reached (44% of its
    fp8 GEMM peak against the NVIDIA parts' 69-82%), so a compute-bound prefill of 405B on
    eight of them takes longer than on an unmeasured part with the same datasheet."""
    mi300x = hardware.get("mi300x")
    unmeasured = replace(mi300x, measured_matmul_tflops=0.0, measured_bandwidth_gbs=0.0, measured_allreduce_gbs=0.0)
    fp8 = models.get("llama-3.1-405b-fp8")
    prefill = StepShape(8192, 0, 8192, 8192 * 4096, 1, num_logits=1)
    measured_s = RooflineCost(mi300x, fp8, 8).step_time(prefill)
    assert measured_s > 1.3 * RooflineCost(unmeasured, fp8, 8).step_time(prefill)
    # The same from a --gpu file: what the user measured on the part is what it reaches.
    path = tmp_path / "mine.yaml"
    path.write_text("memory_gb: 192\nmem_bandwidth_gbs: 5300\nbf16_tflops: 1307.4\nfp8_tflops: 2614.9\n"
                    "link_bandwidth_gbs: 448\nmeasured_matmul_tflops: 1159.5\nmeasured_allreduce_gbs: 316.8\n")
    mine = gpu_file.load(str(path))
    assert mine.matmul_reach == pytest.approx(mi300x.matmul_reach)
    assert RooflineCost(mine, fp8, 8).parts(prefill)["linear_compute_s"] == pytest.approx(
        RooflineCost(mi300x, fp8, 8).parts(prefill)["linear_compute_s"])


def test_a_large_decode_batch_streams_the_cache_after_its_compute_bound_gemms():
    """Linear layers and attention are separate kernels: a step of 1500 decodes of 405B is
    compute-bound in its GEMMs and still reads 1500 contexts of KV after them."""
    cost = RooflineCost(hardware.get("mi300x"), models.get("llama-3.1-405b-fp8"), 8, kv_bytes_per_elem=1.0)
    decode = StepShape(0, 1500, 1500 * 1100, 1500 * 1100, 1500, num_logits=1500)
    p = cost.parts(decode)
    assert p["linear_compute_s"] > p["linear_memory_s"] and p["attention_memory_s"] > p["attention_compute_s"]
    assert cost.step_time(decode) == pytest.approx(
        p["linear_compute_s"] + p["attention_memory_s"] + p["comm_s"] + p["overhead_s"])
    assert cost.bound(decode) == "compute"
