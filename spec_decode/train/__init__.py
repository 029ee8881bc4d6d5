"""Training an EAGLE-3 draft head by self-distillation (`aioengine train-eagle`): prompts,
data generation through the engine, the trainable head and the training loop."""
