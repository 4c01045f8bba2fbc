"""What a training step minimises: the objective over a batch's blocks and the losses under the target head."""
