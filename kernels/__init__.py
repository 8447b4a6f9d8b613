"""Hot loops of teralm, each beside a plain reference implementation that tests compare it to."""
