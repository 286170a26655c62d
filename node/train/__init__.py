"""Local training: the F-TIS loss (`node.train.ftis`) and the trainer that applies it."""
