"""The command line: ``zerocc train | plan | inspect | estimate | profile``, the top layer."""
