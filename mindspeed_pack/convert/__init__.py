"""convert stage of mindspeed-pack."""
