// C++ helpers of mindspeed-pack (pybind11): bin packing and the training sample index.
//
// Both functions do their heavy loop without the GIL and are deterministic on every
// platform: no unstable sorts, no implementation-defined distributions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _MSC_VER
#include <intrin.h>
#endif

namespace py = pybind11;

namespace {

inline int count_trailing_zeros(uint64_t word) {
#ifdef _MSC_VER
    unsigned long index;
    _BitScanForward64(&index, word);
    return static_cast<int>(index);
#else
    return __builtin_ctzll(word);
#endif
}

// 64 x 64 -> 128-bit product as (high, low); the portable branch gives identical results.
inline void multiply_wide(uint64_t a, uint64_t b, uint64_t& high, uint64_t& low) {
#if defined(__SIZEOF_INT128__)
    const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
    high = static_cast<uint64_t>(product >> 64);
    low = static_cast<uint64_t>(product);
#else
    const uint64_t a_lo = a & 0xFFFFFFFFULL, a_hi = a >> 32, b_lo = b & 0xFFFFFFFFULL, b_hi = b >> 32;
    const uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
    const uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFULL) + lo_hi;
    high = hi_hi + (hi_lo >> 32) + (cross >> 32);
    low = (cross << 32) | (lo_lo & 0xFFFFFFFFULL);
#endif
}

// Set of integers in [0, universe) answering "smallest member >= x" in O(log64 universe):
// a 64-ary tree of bit words, level 0 holding one bit per value, each higher level one bit
// per non-empty word below it.
class SuccessorSet {
public:
    explicit SuccessorSet(int64_t universe) : universe_(universe) {
        int64_t words = universe;
        do {
            words = (words + 63) / 64;
            levels_.emplace_back(static_cast<size_t>(words), 0);
        } while (words > 1);
    }

    void insert(int64_t x) {
        for (auto& level : levels_) {
            uint64_t& word = level[static_cast<size_t>(x >> 6)];
            const bool was_empty = word == 0;
            word |= uint64_t{1} << (x & 63);
            if (!was_empty) return;
            x >>= 6;
        }
    }

    void erase(int64_t x) {
        for (auto& level : levels_) {
            uint64_t& word = level[static_cast<size_t>(x >> 6)];
            word &= ~(uint64_t{1} << (x & 63));
            if (word != 0) return;
            x >>= 6;
        }
    }

    // Smallest member >= x, or -1.
    int64_t find_next(int64_t x) const {
        if (x >= universe_) return -1;
        size_t level = 0;
        while (true) {
            if (level == levels_.size()) return -1;
            const auto& words = levels_[level];
            const int64_t word_index = x >> 6;
            if (word_index >= static_cast<int64_t>(words.size())) return -1;
            const uint64_t word = words[static_cast<size_t>(word_index)] & (~uint64_t{0} << (x & 63));
            if (word != 0) {
                x = (word_index << 6) + count_trailing_zeros(word);
                break;
            }
            x = word_index + 1;
            ++level;
        }
        while (level > 0) {
            --level;
            x = (x << 6) + count_trailing_zeros(levels_[level][static_cast<size_t>(x)]);
        }
        return x;
    }

private:
    int64_t universe_;
    std::vector<std::vector<uint64_t>> levels_;
};

// Bins grouped by exact remaining room. Bins with the same room form a FIFO queue (an
// intrusive linked list), so among equally good bins the one that has had that room the
// longest (usually the one opened first) is chosen: deterministic, keeps neighbouring items
// together, and allocates nothing per item. Bin is the id type (int32 halves the memory
// traffic whenever there are fewer than 2^31 items).
// Dense variant: arrays indexed by room value, SuccessorSet to find the best room.
template <class Bin>
class DenseRoomIndex {
public:
    explicit DenseRoomIndex(int64_t capacity)
        : head_(static_cast<size_t>(capacity) + 1, -1), tail_(static_cast<size_t>(capacity) + 1, -1),
          rooms_(capacity + 1) {}

    // Smallest room >= need that some bin has, or -1.
    int64_t best_room(int64_t need) const { return rooms_.find_next(need); }

    Bin pop(int64_t room, const std::vector<Bin>& next) {
        Bin& head = head_[static_cast<size_t>(room)];
        const Bin bin = head;
        head = next[static_cast<size_t>(bin)];
        if (head < 0) rooms_.erase(room);
        return bin;
    }

    void push(int64_t room, Bin bin, std::vector<Bin>& next) {
        next[static_cast<size_t>(bin)] = -1;
        Bin& head = head_[static_cast<size_t>(room)];
        Bin& tail = tail_[static_cast<size_t>(room)];
        if (head < 0) {
            rooms_.insert(room);
            head = bin;
        } else {
            next[static_cast<size_t>(tail)] = bin;
        }
        tail = bin;
    }

private:
    std::vector<Bin> head_;
    std::vector<Bin> tail_;
    SuccessorSet rooms_;
};

// Sparse variant for huge capacities: an ordered map from room to (head, tail) of its queue.
template <class Bin>
class SparseRoomIndex {
public:
    int64_t best_room(int64_t need) const {
        auto it = queues_.lower_bound(need);
        return it == queues_.end() ? -1 : it->first;
    }

    Bin pop(int64_t room, const std::vector<Bin>& next) {
        auto it = queues_.find(room);
        const Bin bin = it->second.first;
        const Bin following = next[static_cast<size_t>(bin)];
        if (following < 0) queues_.erase(it);
        else it->second.first = following;
        return bin;
    }

    void push(int64_t room, Bin bin, std::vector<Bin>& next) {
        next[static_cast<size_t>(bin)] = -1;
        auto it = queues_.find(room);
        if (it == queues_.end()) {
            queues_.emplace(room, std::make_pair(bin, bin));
        } else {
            next[static_cast<size_t>(it->second.second)] = bin;
            it->second.second = bin;
        }
    }

private:
    std::map<int64_t, std::pair<Bin, Bin>> queues_;
};

// Items of one length, in the order BFD places them (longest length first).
struct LengthRun {
    int64_t length;
    int64_t count;
};

// Best-fit decreasing: each item (longest first) goes to the open bin with the least room
// that still holds it, or opens a new bin. Items of equal length are interchangeable for the
// choice of bins, so the loop works on runs of equal lengths and records the bin of the k-th
// placed item in bin_by_rank[k] (sequential writes; no item index is touched here).
template <class Bin, class RoomIndex>
int64_t best_fit_decreasing(const std::vector<LengthRun>& runs, int64_t capacity, RoomIndex& rooms,
                            Bin* bin_by_rank) {
    std::vector<Bin> next_in_queue;  // one slot per bin
    Bin num_bins = 0;
    int64_t rank = 0;
    for (const LengthRun& run : runs) {
        const int64_t length = run.length;
        for (int64_t k = 0; k < run.count; ++k) {
            const int64_t room = rooms.best_room(length);
            Bin bin;
            int64_t room_left;
            if (room < 0) {
                bin = num_bins++;
                next_in_queue.push_back(-1);
                room_left = capacity - length;
            } else {
                bin = rooms.pop(room, next_in_queue);
                room_left = room - length;
            }
            bin_by_rank[rank++] = bin;
            if (room_left > 0) rooms.push(room_left, bin, next_in_queue);  // full bins leave the index
        }
    }
    return num_bins;
}

// Exact-fill refinement: a second packing, built bin by bin, that is kept only when it uses
// fewer bins than BFD. BFD fills bins with the longest items first, so once the items left are
// all longer than every bin's remaining room (no short items), those gaps are lost; on narrow
// length ranges that costs ~0.5% of the bins. This pass fills one bin at a time instead:
// * the next item is taken from the length that has had the smallest fraction of its items
//   packed so far (ties: the longer length), so the items left keep the shape of the input
//   and the last bins still find the lengths they need;
// * an item is only taken if it leaves either no room or room for two of the shortest items
//   left (a gap shorter than that is usually unfillable); failing that, the longest item that
//   still leaves room for one shortest item, failing that the longest that fits;
// * once the room is at most kExactFillItems times the longest length left, a bounded search
//   (kExactFillProbes candidates per item, longest first) looks for 1, 2 or 3 items that fill
//   it exactly, and closes the bin with them.
// Items of one length are interchangeable, so the pass works on runs of equal lengths like BFD
// and records the bin of the k-th item of each run in bin_by_rank. Cost per item: a heap step
// and successor queries over the runs (O(log D), D distinct lengths), plus at most
// kExactFillProbes^2 + kExactFillProbes + 1 count checks per completion attempt.
constexpr int kExactFillItems = 3;
constexpr int kExactFillProbes = 8;

// Index of the first run (runs are by descending length) whose length is <= value, or
// runs.size() if none; dense lookups use a table indexed by value.
class RunLookup {
public:
    RunLookup(const std::vector<LengthRun>& runs, int64_t capacity, bool dense) : runs_(runs), dense_(dense) {
        if (dense) {
            floor_.assign(static_cast<size_t>(capacity) + 1, static_cast<int64_t>(runs.size()));
            size_t r = runs.size();
            for (int64_t v = 1; v <= capacity; ++v) {  // ascending v: the floor run index falls
                while (r > 0 && runs[r - 1].length <= v) --r;
                floor_[static_cast<size_t>(v)] = static_cast<int64_t>(r);
            }
        }
    }

    int64_t floor_run(int64_t value) const {
        if (value < 1) return static_cast<int64_t>(runs_.size());
        if (dense_) return floor_[static_cast<size_t>(std::min<int64_t>(value, static_cast<int64_t>(floor_.size()) - 1))];
        auto it = std::lower_bound(runs_.begin(), runs_.end(), value,
                                   [](const LengthRun& run, int64_t v) { return run.length > v; });
        return static_cast<int64_t>(it - runs_.begin());
    }

    // Run of exactly this length, or -1.
    int64_t exact_run(int64_t value) const {
        const int64_t r = floor_run(value);
        return r < static_cast<int64_t>(runs_.size()) && runs_[static_cast<size_t>(r)].length == value ? r : -1;
    }

private:
    const std::vector<LengthRun>& runs_;
    bool dense_;
    std::vector<int64_t> floor_;
};

template <class Bin>
class ExactFillPacker {
public:
    ExactFillPacker(const std::vector<LengthRun>& runs, int64_t capacity, const RunLookup& lookup, Bin* bin_by_rank)
        : runs_(runs), capacity_(capacity), lookup_(lookup), bin_by_rank_(bin_by_rank),
          left_(runs.size()), used_(runs.size(), 0), rank_start_(runs.size()), present_(static_cast<int64_t>(runs.size()) + 1) {
        int64_t rank = 0;
        for (size_t r = 0; r < runs.size(); ++r) {
            left_[r] = runs[r].count;
            rank_start_[r] = rank;
            rank += runs[r].count;
            present_.insert(static_cast<int64_t>(r));
            heap_.emplace_back(0, static_cast<int64_t>(r));
        }
        std::make_heap(heap_.begin(), heap_.end(), Later{&runs_});
        shortest_ = static_cast<int64_t>(runs.size()) - 1;
    }

    // Number of bins, or -1 as soon as it would need max_bins or more.
    int64_t run(int64_t max_bins) {
        int64_t num_bins = 0;
        while (longest_run() >= 0) {
            if (num_bins + 1 >= max_bins) return -1;
            fill_bin(static_cast<Bin>(num_bins++));
        }
        return num_bins;
    }

private:
    // Heap entry: (packed count of the run when it was pushed, run). The smallest packed
    // fraction used/count comes out first; ties: the longer length (smaller run index).
    using Entry = std::pair<int64_t, int64_t>;
    struct Later {
        const std::vector<LengthRun>* runs;
        bool operator()(const Entry& a, const Entry& b) const {  // true if a comes out after b
            uint64_t ah, al, bh, bl;
            multiply_wide(static_cast<uint64_t>(a.first), static_cast<uint64_t>((*runs)[static_cast<size_t>(b.second)].count), ah, al);
            multiply_wide(static_cast<uint64_t>(b.first), static_cast<uint64_t>((*runs)[static_cast<size_t>(a.second)].count), bh, bl);
            if (ah != bh) return ah > bh;
            if (al != bl) return al > bl;
            return a.second > b.second;
        }
    };

    int64_t length(int64_t r) const { return runs_[static_cast<size_t>(r)].length; }
    int64_t longest_run() const { return present_.find_next(0) < static_cast<int64_t>(runs_.size()) ? present_.find_next(0) : -1; }

    int64_t shortest_length() {
        while (left_[static_cast<size_t>(shortest_)] == 0) --shortest_;
        return length(shortest_);
    }

    // Longest run with items left whose length is <= limit, or -1.
    int64_t longest_at_most(int64_t limit) const {
        const int64_t r = present_.find_next(lookup_.floor_run(limit));
        return r >= 0 && r < static_cast<int64_t>(runs_.size()) ? r : -1;
    }

    // Run with the smallest packed fraction (refreshing stale heap entries), or -1.
    int64_t most_behind() {
        const Later later{&runs_};
        while (!heap_.empty()) {
            const Entry top = heap_.front();
            const size_t r = static_cast<size_t>(top.second);
            if (left_[r] > 0 && top.first == used_[r]) return top.second;
            std::pop_heap(heap_.begin(), heap_.end(), later);
            heap_.pop_back();
            if (left_[r] > 0) {
                heap_.emplace_back(used_[r], top.second);
                std::push_heap(heap_.begin(), heap_.end(), later);
            }
        }
        return -1;
    }

    void take(int64_t r, Bin bin) {
        const size_t i = static_cast<size_t>(r);
        bin_by_rank_[rank_start_[i] + used_[i]] = bin;
        ++used_[i];
        if (--left_[i] == 0) present_.erase(r);
    }

    // Up to `items` runs (non-increasing lengths, each <= max_length) whose lengths sum to
    // room, using items left; appends them to chosen and returns true if found.
    bool exact(int64_t room, int items, int64_t max_length, std::vector<int64_t>& chosen) {
        if (items == 1) {
            if (room > max_length) return false;
            const int64_t r = lookup_.exact_run(room);
            if (r < 0 || left_[static_cast<size_t>(r)] == 0) return false;
            chosen.push_back(r);
            return true;
        }
        const int64_t shortest = length(shortest_);
        int64_t r = present_.find_next(lookup_.floor_run(std::min(max_length, room - (items - 1) * shortest)));
        for (int probe = 0; probe < kExactFillProbes && r >= 0 && r < static_cast<int64_t>(runs_.size()); ++probe) {
            const int64_t a = length(r);
            if (a * items < room) break;  // the rest, no longer than a, cannot make up room
            if (left_[static_cast<size_t>(r)] > 0) {
                --left_[static_cast<size_t>(r)];
                const bool found = exact(room - a, items - 1, a, chosen);
                ++left_[static_cast<size_t>(r)];
                if (found) {
                    chosen.push_back(r);
                    return true;
                }
            }
            r = present_.find_next(r + 1);
        }
        return false;
    }

    void fill_bin(Bin bin) {
        int64_t room = capacity_;
        std::vector<int64_t>& chosen = chosen_;
        while (true) {
            const int64_t longest = longest_run();
            if (longest < 0) return;
            const int64_t shortest = shortest_length();
            if (room < shortest) return;
            if (room <= kExactFillItems * length(longest)) {
                for (int items = 1; items <= kExactFillItems; ++items) {
                    chosen.clear();
                    if (exact(room, items, capacity_, chosen)) {
                        for (const int64_t r : chosen) take(r, bin);
                        return;
                    }
                }
            }
            int64_t pick = -1;
            const int64_t behind = most_behind();
            if (room - length(behind) >= 2 * shortest) {
                pick = behind;
            } else {
                pick = longest_at_most(room - 2 * shortest);
                if (pick < 0) pick = longest_at_most(room - shortest);
                if (pick < 0) pick = longest_at_most(room);
                if (pick < 0) return;
            }
            take(pick, bin);
            room -= length(pick);
        }
    }

    const std::vector<LengthRun>& runs_;
    int64_t capacity_;
    const RunLookup& lookup_;
    Bin* bin_by_rank_;
    std::vector<int64_t> left_, used_, rank_start_;
    std::vector<Entry> heap_;
    SuccessorSet present_;
    int64_t shortest_;
    std::vector<int64_t> chosen_;
};

// ceil(sum / capacity), or 0 (no shortcut) if the sum would overflow.
inline int64_t lower_bound_bins(const std::vector<LengthRun>& runs, int64_t capacity) {
    int64_t total = 0;
    for (const LengthRun& run : runs) {
        if (run.count > (INT64_MAX - total) / run.length) return 0;
        total += run.length * run.count;
    }
    return total / capacity + (total % capacity != 0);
}

// Above this capacity the per-length and per-room arrays would cost more than sorting and
// an ordered map.
constexpr int64_t kDefaultDenseCapacityLimit = int64_t{1} << 24;

// Packs validated lengths; writes item_order (n entries) and returns bin_offsets.
// Ranks: items sorted by length descending, ties by ascending index (a stable order, so the
// result does not depend on any sort's tie handling).
template <class Bin>
std::vector<int64_t> pack_lengths_bfd(const int64_t* lengths, int64_t n, int64_t capacity, bool dense, bool refine,
                                      int64_t* item_order) {
    std::vector<LengthRun> runs;
    std::vector<int64_t> first_rank;  // dense: indexed by length; sparse: parallel to runs
    if (dense) {
        std::vector<int64_t> count(static_cast<size_t>(capacity) + 1, 0);
        for (int64_t i = 0; i < n; ++i) ++count[static_cast<size_t>(lengths[i])];
        first_rank.assign(static_cast<size_t>(capacity) + 1, 0);
        int64_t rank = 0;
        for (int64_t l = capacity; l >= 1; --l) {
            first_rank[static_cast<size_t>(l)] = rank;
            if (count[static_cast<size_t>(l)] > 0) runs.push_back({l, count[static_cast<size_t>(l)]});
            rank += count[static_cast<size_t>(l)];
        }
    } else {
        std::vector<int64_t> sorted(lengths, lengths + n);
        std::sort(sorted.begin(), sorted.end(), std::greater<int64_t>());
        for (int64_t i = 0; i < n; ++i) {
            if (runs.empty() || runs.back().length != sorted[static_cast<size_t>(i)]) {
                runs.push_back({sorted[static_cast<size_t>(i)], 0});
                first_rank.push_back(i);
            }
            ++runs.back().count;
        }
    }

    std::vector<Bin> bin_by_rank(static_cast<size_t>(n));
    int64_t num_bins;
    if (dense) {
        DenseRoomIndex<Bin> rooms(capacity);
        num_bins = best_fit_decreasing(runs, capacity, rooms, bin_by_rank.data());
    } else {
        SparseRoomIndex<Bin> rooms;
        num_bins = best_fit_decreasing(runs, capacity, rooms, bin_by_rank.data());
    }

    if (refine && num_bins > lower_bound_bins(runs, capacity)) {
        const RunLookup lookup(runs, capacity, dense);
        std::vector<Bin> refined(static_cast<size_t>(n));
        ExactFillPacker<Bin> packer(runs, capacity, lookup, refined.data());
        const int64_t refined_bins = packer.run(num_bins);
        if (refined_bins >= 0) {  // fewer bins than BFD
            bin_by_rank.swap(refined);
            num_bins = refined_bins;
        }
    }

    std::vector<int64_t> bin_offsets(static_cast<size_t>(num_bins) + 1, 0);
    for (const Bin bin : bin_by_rank) ++bin_offsets[static_cast<size_t>(bin) + 1];
    for (int64_t b = 0; b < num_bins; ++b) bin_offsets[static_cast<size_t>(b) + 1] += bin_offsets[static_cast<size_t>(b)];

    // Walk items in index order: the j-th item of length l has rank first_rank[l] + j. Writing
    // each at its bin's cursor lists every bin's items in ascending index order.
    std::vector<int64_t> bin_cursor(bin_offsets.begin(), bin_offsets.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
        int64_t* next_rank;
        if (dense) {
            next_rank = &first_rank[static_cast<size_t>(lengths[i])];
        } else {
            // runs are sorted by descending length: binary search for this item's run
            auto it = std::lower_bound(runs.begin(), runs.end(), lengths[i],
                                       [](const LengthRun& run, int64_t l) { return run.length > l; });
            next_rank = &first_rank[static_cast<size_t>(it - runs.begin())];
        }
        const Bin bin = bin_by_rank[static_cast<size_t>((*next_rank)++)];
        item_order[bin_cursor[static_cast<size_t>(bin)]++] = i;
    }
    return bin_offsets;
}

py::tuple pack_best_fit_decreasing(py::array_t<int64_t, py::array::c_style> lengths_array, int64_t capacity,
                                   int64_t dense_capacity_limit, bool wide_bin_ids, bool refine) {
    if (lengths_array.ndim() != 1)
        throw std::invalid_argument("lengths must be 1-D, got " + std::to_string(lengths_array.ndim()) + " dimensions");
    if (capacity < 1) throw std::invalid_argument("capacity must be >= 1, got " + std::to_string(capacity));
    const int64_t n = lengths_array.shape(0);
    const int64_t* lengths = lengths_array.data();

    py::array_t<int64_t> item_order(n);
    int64_t* item_order_out = item_order.mutable_data();
    std::vector<int64_t> bin_offsets;
    std::string error;
    {
        py::gil_scoped_release release;
        for (int64_t i = 0; i < n; ++i) {
            if (lengths[i] < 1 || lengths[i] > capacity) {
                error = "item " + std::to_string(i) + " has length " + std::to_string(lengths[i]) +
                        (lengths[i] < 1 ? ": lengths must be >= 1" : ": longer than the capacity " + std::to_string(capacity));
                break;
            }
        }
        if (error.empty()) {
            const bool dense = capacity <= dense_capacity_limit;
            if (n < INT32_MAX && !wide_bin_ids)
                bin_offsets = pack_lengths_bfd<int32_t>(lengths, n, capacity, dense, refine, item_order_out);
            else
                bin_offsets = pack_lengths_bfd<int64_t>(lengths, n, capacity, dense, refine, item_order_out);
        }
    }
    if (!error.empty()) throw std::invalid_argument(error);
    py::array_t<int64_t> offsets(static_cast<py::ssize_t>(bin_offsets.size()));
    std::copy(bin_offsets.begin(), bin_offsets.end(), offsets.mutable_data());
    return py::make_tuple(item_order, offsets);
}

// ---------------------------------------------------------------------------------------
// Sample index

uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

// Uniform draw in [0, bound), unbiased: Lemire's multiply-shift, rejecting the low products
// that would over-represent some results (a division only on the rare rejection path).
uint64_t bounded_draw(std::mt19937_64& rng, uint64_t bound) {
    uint64_t high, low;
    multiply_wide(rng(), bound, high, low);
    if (low < bound) {
        const uint64_t threshold = (uint64_t{0} - bound) % bound;  // 2^64 mod bound
        while (low < threshold) multiply_wide(rng(), bound, high, low);
    }
    return high;
}

// Fills index[0:num_samples] epoch by epoch. Doc is the element type of the per-epoch order
// (int32 whenever possible: half the memory traffic of the random swaps).
// The shuffle runs forward (position i takes a uniform pick among positions i..n-1), so the
// first k entries of an epoch are final after k draws: a partial last epoch costs only what
// it emits, and the index for fewer samples is a prefix of the index for more.
template <class Doc>
void fill_sample_index(int64_t num_docs, int64_t num_samples, uint64_t seed, bool shuffle, int64_t epoch_length,
                       int64_t* index) {
    std::vector<Doc> order(static_cast<size_t>(num_docs));
    int64_t filled = 0;
    for (uint64_t epoch = 0; filled < num_samples; ++epoch) {
        for (int64_t i = 0; i < num_docs; ++i) order[static_cast<size_t>(i)] = static_cast<Doc>(i);
        const int64_t take = std::min(epoch_length, num_samples - filled);
        if (shuffle) {
            std::mt19937_64 rng(splitmix64(splitmix64(seed) + epoch));
            const int64_t steps = std::min(take, num_docs - 1);
            for (int64_t i = 0; i < steps; ++i) {
                const auto j = i + static_cast<int64_t>(bounded_draw(rng, static_cast<uint64_t>(num_docs - i)));
                std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
            }
        }
        // Entries past num_docs (padded_samples) repeat the epoch's first entries.
        for (int64_t k = 0; k < take; ++k)
            index[filled + k] = order[static_cast<size_t>(k < num_docs ? k : (k - num_docs) % num_docs)];
        filled += take;
    }
}

py::array_t<int64_t> build_sample_index(int64_t num_docs, int64_t num_samples, int64_t seed, bool shuffle,
                                        bool padded_samples, int64_t global_batch_size) {
    if (num_docs < 1) throw std::invalid_argument("num_docs must be >= 1, got " + std::to_string(num_docs));
    if (num_samples < 0) throw std::invalid_argument("num_samples must be >= 0, got " + std::to_string(num_samples));
    if (global_batch_size < 1)
        throw std::invalid_argument("global_batch_size must be >= 1, got " + std::to_string(global_batch_size));
    py::array_t<int64_t> index_array(num_samples);
    int64_t* index = index_array.mutable_data();
    {
        py::gil_scoped_release release;
        int64_t epoch_length = num_docs;
        if (padded_samples && num_docs % global_batch_size != 0)
            epoch_length = (num_docs / global_batch_size + 1) * global_batch_size;
        const auto seed_bits = static_cast<uint64_t>(seed);
        if (num_docs <= INT32_MAX)
            fill_sample_index<int32_t>(num_docs, num_samples, seed_bits, shuffle, epoch_length, index);
        else
            fill_sample_index<int64_t>(num_docs, num_samples, seed_bits, shuffle, epoch_length, index);
    }
    return index_array;
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
    m.doc() = "mindspeed-pack C++ helpers: packing and sample index";
    m.attr("DENSE_CAPACITY_LIMIT") = kDefaultDenseCapacityLimit;
    m.def("pack_best_fit_decreasing", &pack_best_fit_decreasing, py::arg("lengths"), py::arg("capacity"),
          py::arg("dense_capacity_limit") = kDefaultDenseCapacityLimit, py::arg("wide_bin_ids") = false,
          py::arg("refine") = false,
          "Best-fit decreasing packing of int64 lengths; returns (item_order, bin_offsets).\n"
          "refine: also run the exact-fill pass and keep its plan when it uses fewer bins.\n"
          "dense_capacity_limit and wide_bin_ids only select internal code paths (for tests).");
    m.def("build_sample_index", &build_sample_index, py::arg("num_docs"), py::arg("num_samples"), py::arg("seed"),
          py::arg("shuffle"), py::arg("padded_samples"), py::arg("global_batch_size"),
          "int64 document index per training sample; see mindspeed_pack.data.sample_index.");
}
