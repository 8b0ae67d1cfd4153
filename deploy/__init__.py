"""Deploy: what runs on the devices, and how it gets there.

Modules, one concept each: ``student`` (a trainable Llama sharing the engine's config,
loader and RoPE; Hugging Face folder I/O), ``corpus`` (sensor prompts with the teacher's
answers, plus shipped general text), ``distill`` (KL distillation, resumable),
``agreement`` (teacher-forced top-1 agreement, torch or llama.cpp), ``quantize`` (INT4 GGUF
export), ``cli``. The signed image format lives in ``apiary.shared.image`` and the device-side
updater in ``apiary.edge.ota``. See docs/deploy.md.
"""
