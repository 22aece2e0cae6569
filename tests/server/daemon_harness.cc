#include "daemon_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace wprep::testing {

std::string WprepdPath() {
  if (const char* p = std::getenv("WPREPD"); p != nullptr && *p != '\0') return p;
  return WPREPD_PATH;
}

std::unique_ptr<Daemon> Daemon::Start(const std::vector<std::string>& extra_args,
                                      std::string* error, absl::Duration bound) {
  return Start(extra_args, error, bound, StartOptions());
}

std::unique_ptr<Daemon> Daemon::Start(const std::vector<std::string>& extra_args, std::string* error,
                                      absl::Duration bound, const StartOptions& options) {
  std::unique_ptr<Daemon> d(new Daemon());
  char tmpl[] = "/tmp/wprepd-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    *error = "mkdtemp failed";
    return nullptr;
  }
  d->dir_ = tmpl;
  if (options.uid >= 0) chmod(tmpl, 0777);  // the daemon's user writes its socket and port file here
  const std::string port_file = d->dir_ + "/ports";
  const std::string log_file = d->dir_ + "/wprepd.log";
  std::vector<std::string> args = {WprepdPath(), "--listen=unix://" + d->dir_ + "/wprepd.sock"};
  if (!options.no_tcp) args.push_back("--listen=127.0.0.1:0");
  args.push_back("--metrics-address=127.0.0.1:0");
  args.push_back("--port-file=" + port_file);
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    *error = "fork failed";
    return nullptr;
  }
  if (pid == 0) {
    const int fd = open(log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
    }
    if (options.uid >= 0 && (setgid(static_cast<gid_t>(options.uid)) != 0 || setuid(static_cast<uid_t>(options.uid)) != 0)) {
      _exit(126);
    }
    if (options.nproc_limit > 0) {
      const rlimit rl{static_cast<rlim_t>(options.nproc_limit), static_cast<rlim_t>(options.nproc_limit)};
      if (setrlimit(RLIMIT_NPROC, &rl) != 0) _exit(125);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  d->pid_ = pid;
  const absl::Time until = absl::Now() + bound;
  while (absl::Now() < until) {
    std::ifstream f(port_file);
    if (f) {
      std::string kind, addr;
      while (f >> kind >> addr) {
        if (kind == "grpc" && addr.rfind("unix://", 0) == 0) d->unix_target_ = addr;
        else if (kind == "grpc") d->tcp_target_ = addr;
        else if (kind == "metrics") d->metrics_ = addr;
        else if (kind == "health") d->health_ = addr;
      }
      if (!d->unix_target_.empty()) return d;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      d->exited_ = true;
      *error = "wprepd exited during start-up: " + d->Log();
      return nullptr;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  *error = "wprepd did not write its port file: " + d->Log();
  return nullptr;
}

Daemon::~Daemon() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

int Daemon::Health(const std::string& service) const {
  auto channel = grpc::CreateChannel(unix_target_, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) return -1;
  return resp.status();
}

bool Daemon::WaitHealth(int status, absl::Duration bound) const {
  const absl::Time until = absl::Now() + bound;
  while (absl::Now() < until) {
    if (Health() == status) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

bool Daemon::WaitServing(absl::Duration bound) const { return WaitHealth(1, bound); }

void Daemon::Signal(int sig) const {
  if (pid_ > 0 && !exited_) kill(pid_, sig);
}

int Daemon::WaitExit(absl::Duration bound) {
  const absl::Time until = absl::Now() + bound;
  while (absl::Now() < until) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      return status;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return -1;
}

std::string Daemon::Log() const {
  std::ifstream f(dir_ + "/wprepd.log");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

uint64_t Daemon::RssBytes() const {
  std::ifstream f("/proc/" + std::to_string(pid_) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    uint64_t kb = 0;
    if (line.rfind("VmRSS:", 0) == 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)), &kb)) {
      return kb << 10;
    }
  }
  return 0;
}

std::string HttpGet(const std::string& host_port, const std::string& path, absl::Duration timeout) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval tv{};
  tv.tv_sec = absl::ToInt64Seconds(timeout);
  tv.tv_usec = absl::ToInt64Microseconds(timeout) % 1000000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr);
  std::string body;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: " + host_port + "\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) body.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  const size_t hdr_end = body.find("\r\n\r\n");
  return hdr_end == std::string::npos ? "" : body.substr(hdr_end + 4);
}

std::optional<double> MetricValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels) {
  std::optional<double> sum;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (name_end == absl::string_view::npos || line.substr(0, name_end) != name) continue;
    std::map<std::string, std::string> have;
    absl::string_view rest = line.substr(name_end);
    if (rest[0] == '{') {
      const size_t close = rest.find('}');
      if (close == absl::string_view::npos) continue;
      for (absl::string_view kv : absl::StrSplit(rest.substr(1, close - 1), ',', absl::SkipEmpty())) {
        const size_t eq = kv.find('=');
        if (eq == absl::string_view::npos) continue;
        absl::string_view v = kv.substr(eq + 1);
        if (v.size() >= 2 && v.front() == '"') v = v.substr(1, v.size() - 2);
        have[std::string(kv.substr(0, eq))] = std::string(v);
      }
      rest = rest.substr(close + 1);
    }
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = have.find(k);
      if (it == have.end() || it->second != v) match = false;
    }
    if (!match) continue;
    const size_t sp = rest.find_first_not_of(' ');
    double value = 0;
    if (sp == absl::string_view::npos) continue;
    absl::string_view num = rest.substr(sp);
    num = num.substr(0, num.find(' '));
    if (!absl::SimpleAtod(num, &value)) continue;
    sum = sum.value_or(0) + value;
  }
  return sum;
}

DescriptorLimit::DescriptorLimit(pid_t pid, int spare) : pid_(pid) {
  int open_fds = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++open_fds;
  }
  if (ec || prlimit(pid, RLIMIT_NOFILE, nullptr, &old_) != 0) return;
  const rlimit low{static_cast<rlim_t>(open_fds + spare), old_.rlim_max};
  ok_ = prlimit(pid, RLIMIT_NOFILE, &low, nullptr) == 0;
}

bool DescriptorLimit::Restore() {
  if (!ok_) return true;
  ok_ = prlimit(pid_, RLIMIT_NOFILE, &old_, nullptr) != 0;
  return !ok_;
}

std::vector<HandlerSpan> RequestSpans(const std::string& log_text, const std::string& method) {
  std::vector<HandlerSpan> out;
  const std::string tag = absl::StrCat("method=", method, " ");
  std::istringstream log(log_text);
  for (std::string line; std::getline(log, line);) {
    if (line.find("event=request") == std::string::npos || line.find(tag) == std::string::npos ||
        line.rfind("ts=", 0) != 0) {
      continue;
    }
    const size_t sp = line.find(" seconds=");
    HandlerSpan h;
    std::string err;
    if (sp == std::string::npos ||
        !absl::ParseTime("%Y-%m-%dT%H:%M:%E*SZ", line.substr(3, line.find(' ') - 3), &h.end, &err)) {
      continue;
    }
    h.seconds = std::atof(line.c_str() + sp + 9);
    const size_t kp = line.find(" kernel_seconds=");
    if (kp != std::string::npos) h.kernel_seconds = std::atof(line.c_str() + kp + 16);
    h.line = std::move(line);
    out.push_back(std::move(h));
  }
  return out;
}

std::vector<ThreadStat> ThreadsOf(pid_t pid) {
  std::vector<ThreadStat> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/task"), ec)) {
    std::ifstream f(e.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    // pid (comm) state ppid ...: the comm may hold spaces, so count fields after ')'.
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::vector<std::string> f3 = absl::StrSplit(text.substr(close + 2), ' ', absl::SkipEmpty());
    ThreadStat t;
    // Fields 14 (utime), 15 (stime) and 41 (policy), counting from 1; f3[0] is field 3.
    uint64_t utime = 0, stime = 0;
    if (f3.size() < 39 || !absl::SimpleAtoi(e.path().filename().string(), &t.tid) ||
        !absl::SimpleAtoi(f3[11], &utime) || !absl::SimpleAtoi(f3[12], &stime) ||
        !absl::SimpleAtoi(f3[38], &t.policy)) {
      continue;
    }
    t.ticks = utime + stime;
    out.push_back(t);
  }
  return out;
}

}  // namespace wprep::testing
