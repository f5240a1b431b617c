"""Training MTP heads by self-distillation (`hybridrt train-mtp`): config.py (torch-free: the CLI's
option defaults), train.py (the training), torch_model.py, prompts.py."""
