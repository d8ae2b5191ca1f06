# TRL's DPOTrainer on the same model, data, batch and steps; gradient checkpointing off, CPU; saves
# the model.
import json
import os
import sys
import time
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer

# usage: python bench/trl_dpo.py MODEL DATA STEPS BATCH fp32|bf16 OUT_DIR [LORA_RANK] (in a venv
# with trl==1.16.0 and datasets; peft==0.21.2 for LORA_RANK, which trains LoRA adapters of that
# rank) TRL_ARGS='{"loss_type": ["sigmoid", "sft"]}' adds DPOConfig arguments;
# OUT_DIR/log_history.json gets the step logs. The last line printed: pairs/s between the first and
# the last step, as bench/steady.py measures this repo's runs.
model_dir, data_path, precision, out = sys.argv[1], sys.argv[2], sys.argv[5], sys.argv[6]
steps, batch = int(sys.argv[3]), int(sys.argv[4])
lora_rank = int(sys.argv[7]) if len(sys.argv) > 7 else 0
peft_config = None
if lora_rank:  # as this repo's --lora-rank: alpha 16, no dropout, every linear layer in the blocks
    from peft import LoraConfig

    peft_config = LoraConfig(
        r=lora_rank,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
settings = dict(
    output_dir=out + "-trainer",
    per_device_train_batch_size=batch,
    max_steps=steps,
    learning_rate=1e-5,
    beta=0.1,
    max_length=512,
    gradient_checkpointing=False,
    use_cpu=True,
    bf16=precision == "bf16",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    dataloader_num_workers=0,
    seed=0,
)
config = DPOConfig(**{**settings, **json.loads(os.environ.get("TRL_ARGS", "{}"))})


class StepTimes(TrainerCallback):
    """The clock at each optimizer step's end."""

    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


step_times = StepTimes()
trainer = DPOTrainer(
    model=model,
    args=config,
    train_dataset=load_dataset("json", data_files=data_path)["train"],
    processing_class=tok,
    peft_config=peft_config,
    callbacks=[step_times],
)
trainer.train()
trainer.save_model(
    out
)  # like the others, end with the trained model (with peft: the adapters) on disk
with open(os.path.join(out, "log_history.json"), "w") as f:
    json.dump(trainer.state.log_history, f)
times = step_times.times
steady = (len(times) - 1) * batch / (times[-1] - times[0])
print(json.dumps({"steps": len(times), "steady_pairs_per_s": round(steady, 2)}))
