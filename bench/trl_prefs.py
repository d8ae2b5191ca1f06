# TRL's KTOTrainer, ORPOTrainer, CPOTrainer and RewardTrainer on the same model, data, batch and
# steps; gradient checkpointing off, CPU; the data is read in the file's order. Nothing is saved but
# the step logs.
import json
import os
import sys
import time
from datasets import load_dataset
from torch.utils.data import SequentialSampler
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)
from trl import KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

# usage: python bench/trl_prefs.py kto|orpo|cpo|reward MODEL DATA STEPS BATCH fp32|bf16 OUT_DIR
# (in a venv with trl==1.16.0 and datasets) TRL_ARGS='{"loss_type": "apo_zero_unpaired"}' adds
# config arguments. DATA rows: kto {"prompt", "completion", "label": bool}; orpo, cpo and reward
# {"prompt", "chosen", "rejected"}, reward's with an optional "margin". reward: MODEL is a sequence
# classifier with one label (its head saved, so that both sides start from it), and the rows are
# tokenized here as prompt + response, EOS appended (the byte tokenizer adds it): given as text,
# TRL would append the EOS's text and the tokenizer a second EOS. OUT_DIR/log_history.json gets
# the step logs. The last line printed: completions/s (kto) or pairs/s (the others) between the
# first and the last step, as bench/steady.py measures this repo's runs.
#
# The learning rate: TRL keeps transformers' defaults, lr_scheduler_type="linear" and
# warmup_steps=0, so it falls linearly from 1e-5 at the first step towards 0 after STEPS steps (step
# k, from 0, uses 1e-5 * (STEPS - k) / STEPS); AdamW (torch), weight decay 0, max_grad_norm 1.0.
#
# Truncation, with max_length=512 here: KTO cuts prompt+completion to max_length keeping the start
# (default max_length 1024) and drops rows whose prompt alone has max_length tokens; KTOConfig has
# no max_prompt_length / max_completion_length in 1.16. ORPO and CPO (default max_length 1024; None
# means 512) cut only the completion so that prompt+completion fits, never the prompt; their
# max_completion_length (default None) is used for encoder-decoder models only, set None anyway.
trainer_name, model_dir, data_path = sys.argv[1], sys.argv[2], sys.argv[3]
steps, batch, precision, out = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
Config, Trainer = {
    "kto": (KTOConfig, KTOTrainer),
    "orpo": (ORPOConfig, ORPOTrainer),
    "cpo": (CPOConfig, CPOTrainer),
    "reward": (RewardConfig, RewardTrainer),
}[trainer_name]
tok = AutoTokenizer.from_pretrained(model_dir)
if trainer_name == "reward":
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
else:
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
    # KTO requires it while the KL term is on (every loss_type but "apo_zero_unpaired"): the KL
    # completions are the batch's completions rotated by one, fixed when the data is prepared.
    # ORPOConfig and CPOConfig inherit transformers' train_sampling_strategy (default "random") and
    # neither trainer overrides _get_train_sampler, so this keeps the file's order for all three.
    train_sampling_strategy="sequential",
)
if trainer_name in ("orpo", "cpo"):
    settings["max_completion_length"] = None
if trainer_name == "reward":
    del settings["beta"]
config = Config(**{**settings, **json.loads(os.environ.get("TRL_ARGS", "{}"))})
assert config.train_sampling_strategy == "sequential"


class StepTimes(TrainerCallback):
    """The clock at each optimizer step's end."""

    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


dataset = load_dataset("json", data_files=data_path)["train"]
if trainer_name == "reward":
    dataset = dataset.map(
        lambda row: {
            "chosen_ids": tok(row["prompt"] + row["chosen"]).input_ids,
            "rejected_ids": tok(row["prompt"] + row["rejected"]).input_ids,
        },
        remove_columns=["prompt", "chosen", "rejected"],
    )
step_times = StepTimes()
trainer = Trainer(
    model=model,
    args=config,
    train_dataset=dataset,
    processing_class=tok,
    callbacks=[step_times],
)
assert isinstance(trainer._get_train_sampler(), SequentialSampler)
trainer.train()
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "log_history.json"), "w") as f:
    json.dump(trainer.state.log_history, f)
times = step_times.times
steady = (len(times) - 1) * batch / (times[-1] - times[0])
unit = "completions" if trainer_name == "kto" else "pairs"
print(json.dumps({"steps": len(times), f"steady_{unit}_per_s": round(steady, 2)}))
