"""west: speech-LLM training with honest sequence packing."""
from setuptools import find_packages, setup

# torch: the releases west is tested on (2.11 on the GPU machines, 2.13 on the CPU), so that an
# installed CUDA build in that range is kept; tools/setup_env.sh installs the 2.13 CPU wheel first
# for the demo, since pip alone would pull a multi-GB CUDA build on a fresh machine.
INSTALL_REQUIRES = [
    "torch>=2.11,<2.14",
    "numpy>=1.24",
    "numba>=0.60",
    "transformers>=5.0",
    "tokenizers>=0.21",
    "sentencepiece>=0.2",
    "safetensors>=0.4",
    "kaldiio>=2.18",
    "soundfile>=0.12",
    "soxr>=0.5",
    "kaldi-native-fbank>=1.20",
    "pyyaml>=6.0",
    "tqdm>=4.66",
    "tensorboard>=2.15",
    "matplotlib>=3.8",
    "psutil>=5.9",
    "editdistance>=0.8",
]

EXTRAS = {
    # GPU-only kernels and counters; imported lazily, never required.
    "gpu": ["flash-attn>=2.6", "nvidia-ml-py>=12.0"],
    # Offline Mandarin synthesis for the built-in corpus; the English demo corpus needs only
    # espeakng-loader, and its recipe scores with the english normalizer (whisper-normalizer).
    "tts": ["espeakng-loader>=0.2.4", "jieba>=0.42", "pypinyin>=0.50", "whisper-normalizer>=0.1.12"],
    # Scoring normalizers (west.infer.scoring): english = Whisper's English normalization,
    # mandarin = traditional-to-simplified conversion for the mandarin_t2s normalizer.
    "english": ["whisper-normalizer>=0.1.12"],
    "mandarin": ["opencc>=1.1.9"],
    # torchaudio pins its own torch (a CUDA build on PyPI): opt-in only.
    "torchaudio": ["torchaudio"],
    # Reference packer compared side by side in tools/bench_packing.py.
    "bench": ["lightbinpack>=0.1.1"],
    # LoRA adapters (model.lora); also in dev, so every LoRA test runs in CI.
    "lora": ["peft>=0.21"],
    # Packing with TRL's SFTTrainer (west.hf.PackingMixin); also in dev, so its test runs in CI.
    "hf": ["trl>=1.16"],
    # Lhotse CutSets and Shar as training lists (data.data_type lhotse / shar); lhotse 1.33 imports
    # urllib3 without declaring it; lilcom reads Lhotse's compressed features (Shar's default). Also
    # in dev, so their tests run in CI.
    "lhotse": ["lhotse>=1.30", "urllib3>=1.26", "lilcom>=1.7"],
    # Hugging Face datasets (save_to_disk, parquet) as training lists (data.data_type hf); also in dev.
    "datasets": ["datasets>=3.0"],
    "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "peft>=0.21", "ruff>=0.6", "trl>=1.16",
            "whisper-normalizer>=0.1.12", "opencc>=1.1.9",
            "lhotse>=1.30", "urllib3>=1.26", "lilcom>=1.7", "datasets>=3.0"],
}

setup(
    # "west" on PyPI is another project (Zephyr's meta-tool, whose import package is also "west"):
    # this one installs from a checkout, `pip install -e '.[extras]'`, as west-speech
    name="west-speech",
    version="0.1.0",
    description="Speech-LLM training toolkit: Conformer + projector + causal LLM, "
    "with static, dynamic and exact sequence-packed batches.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["west", "west.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "west-train=west.bin.train:main",
            "west-decode=west.bin.decode:main",
            "west-benchmark=west.bin.benchmark:main",
            "west-export=west.bin.export:main",
        ]
    },
)
