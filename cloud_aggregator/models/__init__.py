"""Models at work on the devices: push, answers, rollouts, and the torch backbones."""
