#include "engine/model/npz.h"

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "kernels/dtype.h"

namespace kvlens {
namespace {

constexpr uint32_t kEndSig = 0x06054b50, kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50,
                   kCentralSig = 0x02014b50, kLocalSig = 0x04034b50;

// Little-endian reads within [data, data + size); `ok` turns false past the end.
class Reader {
 public:
  Reader(const uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  template <typename U>
  U At(uint64_t off) {
    U v{};
    if (off > size_ || size_ - off < sizeof(U)) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, data_ + off, sizeof(U));
    return v;
  }
  bool ok() const { return ok_; }

 private:
  const uint8_t* data_;
  uint64_t size_;
  bool ok_ = true;
};

absl::Status Bad(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// The value of 'key' in a .npy header dict: the text from after "'key':" to the next
// top-level comma (a shape tuple is kept whole).
absl::string_view DictValue(absl::string_view header, absl::string_view key) {
  const std::string quoted = absl::StrCat("'", std::string(key), "':");
  const size_t at = header.find(quoted);
  if (at == absl::string_view::npos) return {};
  absl::string_view v = absl::StripLeadingAsciiWhitespace(header.substr(at + quoted.size()));
  size_t end = 0;
  int depth = 0;
  for (; end < v.size(); ++end) {
    if (v[end] == '(') ++depth;
    if (v[end] == ')') --depth;
    if ((v[end] == ',' || v[end] == '}') && depth == 0) break;
  }
  return absl::StripTrailingAsciiWhitespace(v.substr(0, end));
}

// One .npy member: header parsed, data located.
absl::StatusOr<NpzArray> ParseNpy(const std::string& path, const std::string& name,
                                  const uint8_t* p, uint64_t size) {
  const std::string where = absl::StrCat("array ", name, ": ");
  if (size < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) {
    return Bad(path, where + "not a .npy (no \\x93NUMPY magic)");
  }
  const int major = p[6];
  uint64_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = uint64_t{p[8]} | uint64_t{p[9]} << 8;
    start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) return Bad(path, where + "truncated .npy header");
    uint32_t n = 0;
    std::memcpy(&n, p + 8, 4);
    header_len = n;
    start = 12;
  } else {
    return Bad(path, absl::StrCat(where, ".npy version ", major, " is not 1, 2 or 3"));
  }
  if (start + header_len > size) return Bad(path, where + "the .npy header runs past the member");
  const absl::string_view header(reinterpret_cast<const char*>(p + start), header_len);
  NpzArray a;
  a.name = name;
  absl::string_view descr = DictValue(header, "descr");
  if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"')) {
    return Bad(path, where + "the .npy header has no 'descr'");
  }
  a.descr = std::string(descr.substr(1, descr.size() - 2));
  if (DictValue(header, "fortran_order") != "False") {
    return Bad(path, where + "fortran_order is not False (kvlens reads C-order arrays)");
  }
  absl::string_view shape = DictValue(header, "shape");
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')') {
    return Bad(path, where + "the .npy header has no 'shape' tuple");
  }
  uint64_t count = 1;
  for (absl::string_view d :
       absl::StrSplit(shape.substr(1, shape.size() - 2), ',', absl::SkipWhitespace())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(d), &v) || v < 0 || v > (int64_t{1} << 40)) {
      return Bad(path,
                 absl::StrCat(where, "shape ", std::string(shape), " is not a tuple of sizes"));
    }
    a.shape.push_back(v);
    count *= static_cast<uint64_t>(v);
  }
  int elem = 0;
  if (a.descr == "<f4" || a.descr == "<i4" || a.descr == "<u4") elem = 4;
  if (a.descr == "<f2") elem = 2;
  if (a.descr == "<f8" || a.descr == "<i8") elem = 8;
  if (elem == 0) return Bad(path, where + "dtype '" + a.descr + "' is not one kvlens reads");
  a.data = p + start + header_len;
  a.nbytes = count * elem;
  if (a.nbytes != size - start - header_len) {
    return Bad(path, absl::StrCat(where, "holds ", size - start - header_len, " bytes of data, ",
                                  a.descr, " × ", std::string(shape), " needs ", a.nbytes));
  }
  return a;
}

}  // namespace

const NpzArray* NpzFile::Find(const std::string& name) const {
  const auto it = arrays_.find(name);
  return it == arrays_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<NpzFile>> NpzFile::Open(const std::string& path) {
  auto mapped = MappedFile::Open(path);
  if (!mapped.ok()) return mapped.status();
  auto f = std::unique_ptr<NpzFile>(new NpzFile());
  f->file_ = *std::move(mapped);
  const uint8_t* base = f->file_->data();
  const uint64_t size = f->file_->size();
  Reader r(base, size);
  // The end-of-central-directory record: the last signature within the final 64 KiB + 22.
  if (size < 22) return Bad(path, "too short for a zip archive (.npz)");
  uint64_t eocd = 0;
  bool found = false;
  for (uint64_t back = 22; back <= size && back <= 22 + 65535; ++back) {
    if (r.At<uint32_t>(size - back) == kEndSig) {
      eocd = size - back;
      found = true;
      break;
    }
  }
  if (!found) return Bad(path, "no zip end-of-central-directory record: not an .npz");
  uint64_t entries = r.At<uint16_t>(eocd + 10);
  uint64_t cd_size = r.At<uint32_t>(eocd + 12);
  uint64_t cd_offset = r.At<uint32_t>(eocd + 16);
  if (eocd >= 20 && r.At<uint32_t>(eocd - 20) == kZip64LocatorSig) {
    const uint64_t z = r.At<uint64_t>(eocd - 20 + 8);
    if (r.At<uint32_t>(z) != kZip64EndSig) return Bad(path, "broken zip64 end record");
    entries = r.At<uint64_t>(z + 32);
    cd_size = r.At<uint64_t>(z + 40);
    cd_offset = r.At<uint64_t>(z + 48);
  }
  if (!r.ok() || cd_offset > size || cd_size > size - cd_offset) {
    return Bad(path, "the zip central directory lies outside the file");
  }
  uint64_t at = cd_offset;
  for (uint64_t e = 0; e < entries; ++e) {
    if (r.At<uint32_t>(at) != kCentralSig) {
      return Bad(path, absl::StrCat("zip central directory entry ", e, " has a bad signature"));
    }
    const uint16_t method = r.At<uint16_t>(at + 10);
    uint64_t comp = r.At<uint32_t>(at + 20), uncomp = r.At<uint32_t>(at + 24);
    const uint16_t name_len = r.At<uint16_t>(at + 28), extra_len = r.At<uint16_t>(at + 30),
                   comment_len = r.At<uint16_t>(at + 32);
    uint64_t local = r.At<uint32_t>(at + 42);
    if (!r.ok() || at + 46 + name_len > size) return Bad(path, "truncated zip central directory");
    const std::string member(reinterpret_cast<const char*>(base + at + 46), name_len);
    // zip64 extra field: the 64-bit sizes and offset that the 32-bit fields mark 0xFFFFFFFF.
    for (uint64_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {
      const uint16_t id = r.At<uint16_t>(x), len = r.At<uint16_t>(x + 2);
      if (id == 0x0001) {
        uint64_t y = x + 4;
        if (uncomp == 0xFFFFFFFF) uncomp = r.At<uint64_t>(y), y += 8;
        if (comp == 0xFFFFFFFF) comp = r.At<uint64_t>(y), y += 8;
        if (local == 0xFFFFFFFF) local = r.At<uint64_t>(y);
      }
      x += 4 + len;
    }
    absl::string_view name = member;
    if (!absl::ConsumeSuffix(&name, ".npy")) {
      return Bad(path, "member " + member + " is not a .npy array");
    }
    if (method != 0) {
      return Bad(path,
                 absl::StrCat("array ", std::string(name), " is compressed (zip method ", method,
                              ", np.savez_compressed); kvlens maps np.savez's stored "
                              "arrays: re-save with np.savez"));
    }
    if (r.At<uint32_t>(local) != kLocalSig || !r.ok()) {
      return Bad(path, "array " + std::string(name) + ": bad zip local header");
    }
    const uint64_t data = local + 30 + r.At<uint16_t>(local + 26) + r.At<uint16_t>(local + 28);
    if (!r.ok() || data > size || comp > size - data || comp != uncomp) {
      return Bad(path, "array " + std::string(name) + ": its bytes lie outside the file");
    }
    auto a = ParseNpy(path, std::string(name), base + data, comp);
    if (!a.ok()) return a.status();
    f->arrays_.emplace(a->name, *std::move(a));
    at += 46 + name_len + extra_len + comment_len;
  }
  return f;
}

absl::StatusOr<std::vector<float>> NpzFloats(const NpzArray& a) {
  const uint64_t n = a.descr == "<f4"   ? a.nbytes / 4
                     : a.descr == "<f2" ? a.nbytes / 2
                                        : a.nbytes / 8;
  std::vector<float> out(n);
  if (a.descr == "<f4") {
    std::memcpy(out.data(), a.data, a.nbytes);
  } else if (a.descr == "<f2") {
    for (uint64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, a.data + 2 * i, 2);
      out[i] = kernels::F16ToF32(h);
    }
  } else if (a.descr == "<f8") {
    for (uint64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, a.data + 8 * i, 8);
      out[i] = static_cast<float>(d);
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("array ", a.name, ": dtype '", a.descr, "' is not a float type"));
  }
  return out;
}

}  // namespace kvlens
